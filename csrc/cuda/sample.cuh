// The fixed threshold sample of a segment and its ks-th largest key, shared
// by select.cu (keys of x) and compensate.cu (keys of grad + residual,
// computed on the fly, so the fused pass can filter while it compensates).
//
// The sample is reference.threshold_sample_positions: every entry of a
// segment of up to GTOPK_SAMPLE entries, else GTOPK_SAMPLE / GTOPK_RUN runs
// of GTOPK_RUN contiguous entries starting at r * (n / runs).  One block per
// segment sorts the sampled keys (bitonic, shared memory, descending) and
// writes the ks-th largest.
#pragma once

#include "common.cuh"

#define GTOPK_SAMPLE 4096  // reference.THRESHOLD_SAMPLE
#define GTOPK_RUN 128      // reference.THRESHOLD_RUN

namespace gtopk {

// thr[s] = the tpar[s]-th largest key of segment s's sample (tpar[s] <= 0 is
// decided on the host: 0 -> take everything (thr 0), -1 -> nothing (thr ~0)).
// key_at(i): the magnitude key of global position i.
template <class KeyAt>
__device__ __forceinline__ void sample_threshold(const KeyAt& key_at, const gtopk_i64* seg,
                                                 const gtopk_i64* tpar, gtopk_u64* thr) {
  __shared__ gtopk_u64 keys[GTOPK_SAMPLE];
  const int s = blockIdx.x;
  const gtopk_i64 ks = tpar[s];
  if (ks <= 0) {
    if (threadIdx.x == 0) thr[s] = ks == 0 ? 0ull : ~0ull;
    return;
  }
  const gtopk_i64 lo = seg[s], n = seg[s + 1] - seg[s];
  const gtopk_i64 m = n <= GTOPK_SAMPLE ? n : GTOPK_SAMPLE;
  const gtopk_i64 step = n / (GTOPK_SAMPLE / GTOPK_RUN);
  for (int p = threadIdx.x; p < GTOPK_SAMPLE; p += blockDim.x) {
    gtopk_u64 kk = 0ull;  // padding ranks below every real key (keys are >= 0)
    if (p < m) {
      const gtopk_i64 pos = n <= GTOPK_SAMPLE ? p : (p / GTOPK_RUN) * step + (p % GTOPK_RUN);
      kk = key_at(lo + pos);
    }
    keys[p] = kk;
  }
  // Bitonic sort, descending.
  for (int size = 2; size <= GTOPK_SAMPLE; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      for (int i = threadIdx.x; i < GTOPK_SAMPLE; i += blockDim.x) {
        const int l = i ^ stride;
        if (l > i) {
          const gtopk_u64 a = keys[i], b = keys[l];
          const bool desc = (i & size) == 0;
          if (desc ? (a < b) : (a > b)) {
            keys[i] = b;
            keys[l] = a;
          }
        }
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) thr[s] = keys[ks - 1];
}

}  // namespace gtopk
