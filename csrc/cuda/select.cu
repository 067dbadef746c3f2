// Segmented exact top-k and threshold selection on CUDA; mirrors
// csrc/cpu/select.cpp (same operations, same results: the reference's).
//
// Exact top-k: the radix select of radix.cuh over the dense segments of x
// (gtopk_radix_init, then gtopk_topk_pass_* for j = 0 .. npass; the host
// sorts the selected positions and gathers the values).  Segments large
// enough to have a candidate buffer first try a sampled start (as
// csrc/cpu/select.cpp's sample_bound): L = the R-th largest key of the
// threshold sample, R = ceil(q + 4 sqrt(q) + 8) for q = k m / n, so that
// count(key >= L) is a little over k with high probability;
// gtopk_bound_collect_* writes those entries to the candidate buffer in one
// pass over x, and gtopk_bound_decide starts the radix select from them when
// they are at least k and fit -- every entry of the top-k is then among them.
// Otherwise (or for small segments) the radix select reads x.
//
// Threshold selection, exactly reference._threshold_segment, per segment:
//   1. gtopk_thr_sample_*: t = the ks-th largest key of the fixed sample
//      (all entries up to 4096, else 32 runs of 128 entries at r * (n / 32));
//      ks is computed on the host with the reference's own float arithmetic;
//   2. gtopk_thr_count_*: one pass over x counting the entries with key >= t
//      and writing their positions into the segment's output slots (as many
//      as fit; there is room for floor(1.1 k), the most that can be kept);
//   3. gtopk_thr_decide: a count within [ceil(0.9 k), floor(1.1 k)] is the
//      result; otherwise the segment's slots are cleared (gtopk_thr_clear)
//      and the radix select computes its exact top-k (the reference's two
//      corrections both come down to the exact top-k of the segment: with
//      too many entries >= t the k-th largest key is >= t, so the exact
//      top-k lies among them).
// Every entry >= t is either returned, or the exact top-k is: nothing that
// was selected is ever dropped, and the count is known only after the
// kernels (the host reads it once).
#include "radix.cuh"
#include "sample.cuh"

namespace gtopk {

// Keys of a dense segment of x (the sample's key_at).
template <class V>
struct DenseKey {
  const typename V::bits_t* x;
  __device__ __forceinline__ gtopk_u64 operator()(gtopk_i64 i) const { return V::key(x[i]); }
};

template <class V>
__device__ __forceinline__ void thr_sample(const typename V::bits_t* x, const gtopk_i64* seg,
                                           const gtopk_i64* tpar, gtopk_u64* thr) {
  DenseKey<V> key_at;
  key_at.x = x;
  sample_threshold(key_at, seg, tpar, thr);
}

// Positions of the entries with key >= thr[s]: counter[s] counts them all,
// the first (as many as fit in [outo[s], outo[s + 1])) are written to out.
// thr[s] == ~0 (no key reaches it): nothing to do, x is not read.
template <class V, typename I>
__device__ __forceinline__ void collect_ge(const typename V::bits_t* x, const gtopk_i64* lay, int S,
                                           const gtopk_u64* thr, gtopk_u64* counter, I* out,
                                           const gtopk_i64* outo) {
  __shared__ gtopk_u64 sh_scan[32];
  __shared__ gtopk_i64 sh_base;
  const gtopk_i64* seg = lay;
  const gtopk_i64* blk = lay + (S + 1);
  const int tid = threadIdx.x;
  const int s = find_range(blk, S, static_cast<gtopk_i64>(blockIdx.x));
  const gtopk_i64 c = static_cast<gtopk_i64>(blockIdx.x) - blk[s];
  const gtopk_i64 lo = seg[s], n = seg[s + 1] - lo;
  const gtopk_u64 t = thr[s];
  if (t == ~0ull) return;  // uniform per block
  gtopk_u64 emask = 0ull;
  const gtopk_i64 first = c * GTOPK_CHUNK + tid;
  for (int m = 0; m < GTOPK_ITEMS; ++m) {
    const gtopk_i64 i = first + static_cast<gtopk_i64>(m) * GTOPK_THREADS;
    if (i >= n) break;
    if (V::key(x[lo + i]) >= t) emask |= 1ull << m;
  }
  const gtopk_u64 ne = static_cast<gtopk_u64>(__popcll(emask));
  gtopk_u64 tot;
  const gtopk_u64 excl = block_inclusive_scan(ne, sh_scan, &tot) - ne;
  if (tid == 0) sh_base = tot ? static_cast<gtopk_i64>(atomicAdd(&counter[s], tot)) : 0;
  __syncthreads();
  const gtopk_i64 obase = outo[s], ocap = outo[s + 1] - obase;
  gtopk_i64 e = sh_base + static_cast<gtopk_i64>(excl);
  for (gtopk_u64 mk = emask; mk; mk &= mk - 1ull) {
    const int m = __ffsll(static_cast<long long>(mk)) - 1;
    if (e < ocap) out[obase + e] = static_cast<I>(lo + first + static_cast<gtopk_i64>(m) * GTOPK_THREADS);
    ++e;
  }
}

}  // namespace gtopk

// Exact top-k, sampled start (after gtopk_radix_init, gtopk_thr_sample_* with
// the bound's sample rank and gtopk_bound_collect_*, which put the entries
// with key >= the bound into cand0 and counted them in ctr[2S + s]): a
// segment whose candidates number at least r and all fit starts its radix
// select from them instead of x.  A segment without a bound, or whose bound
// failed, reads x as usual.  The candidate counters are reset for the passes.
extern "C" __global__ void gtopk_bound_decide(const gtopk_i64* lay, int S, gtopk_u64* ctr,
                                              gtopk_i64* st) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= S) return;
  const gtopk_i64* cap = lay + 2 * (S + 1);
  const gtopk_i64 cnt = static_cast<gtopk_i64>(ctr[2 * S + s]);
  gtopk_i64* p = st + static_cast<gtopk_i64>(s) * gtopk::ST_N;
  if (p[gtopk::ST_FIN] != -1 && cnt >= p[gtopk::ST_R] && cnt > 0 && cnt <= cap[s + 1] - cap[s]) {
    p[gtopk::ST_SRC] = 1;  // cand0
    p[gtopk::ST_SRCN] = cnt;
  }
  ctr[2 * S + s] = 0ull;
}

// Segments whose count is within [cpar[2s], cpar[2s+1]] keep it; the others
// restart as an exact top-k (output count reset, radix state initialised).
extern "C" __global__ void gtopk_thr_decide(const gtopk_i64* seg, const gtopk_i64* k,
                                            const gtopk_i64* cpar, int S, gtopk_u64* ctr,
                                            gtopk_i64* st) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= S) return;
  const gtopk_i64 cnt = static_cast<gtopk_i64>(ctr[S + s]);
  gtopk_i64* p = st + static_cast<gtopk_i64>(s) * gtopk::ST_N;
  const gtopk_i64 n = seg[s + 1] - seg[s];
  const gtopk_i64 r0 = k[s] < n ? k[s] : n;
  const bool keep = (cpar[2 * s] <= cnt && cnt <= cpar[2 * s + 1]) || r0 <= 0;
  p[gtopk::ST_R] = keep ? 0 : r0;
  p[gtopk::ST_KP] = 0;
  p[gtopk::ST_IP] = 0;
  p[gtopk::ST_B] = 0;
  p[gtopk::ST_FIN] = keep ? -1 : GTOPK_I64_MAX;
  p[gtopk::ST_SRC] = 0;
  p[gtopk::ST_SRCN] = 0;
  p[gtopk::ST_DST] = 0;
  if (!keep) ctr[S + s] = 0ull;
}

#define GTOPK_THR_CLEAR(SUF, I)                                                              \
  extern "C" __global__ void gtopk_thr_clear_##SUF(const gtopk_i64* outo, int S,             \
                                                   const gtopk_i64* st, I* out) {            \
    const gtopk_i64 p = static_cast<gtopk_i64>(blockIdx.x) * blockDim.x + threadIdx.x;       \
    if (p >= outo[S]) return;                                                                \
    const int s = gtopk::find_range(outo, S, p);                                             \
    if (st[static_cast<gtopk_i64>(s) * gtopk::ST_N + gtopk::ST_FIN] != -1)                   \
      out[p] = gtopk::IndexMax<I>::value();                                                  \
  }
GTOPK_THR_CLEAR(i32, int)
GTOPK_THR_CLEAR(i64, long long)

#define GTOPK_SELECT_VALUE(VS, V)                                                            \
  extern "C" __global__ void __launch_bounds__(GTOPK_THREADS)                                \
      gtopk_thr_sample_##VS(const V::bits_t* x, const gtopk_i64* seg, const gtopk_i64* tpar, \
                            gtopk_u64* thr) {                                                \
    gtopk::thr_sample<V>(x, seg, tpar, thr);                                                 \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(GTOPK_THREADS) gtopk_bound_collect_##VS(      \
      const V::bits_t* x, const gtopk_i64* lay, int S, const gtopk_u64* thr, gtopk_u64* ctr, \
      gtopk_i64* cand0) {                                                                    \
    gtopk::collect_ge<V>(x, lay, S, thr, ctr + 2 * S, cand0, lay + 2 * (S + 1));             \
  }

#define GTOPK_SELECT_VALUE_INDEX(VS, V, IS, I)                                               \
  extern "C" __global__ void __launch_bounds__(GTOPK_THREADS) gtopk_topk_pass_##VS##_##IS(   \
      const V::bits_t* x, const gtopk_i64* lay, int S, int j, int kbits, int wbits,          \
      gtopk_i64* st, gtopk_u64* hist, gtopk_u64* ctr, gtopk_i64* cand0, gtopk_i64* cand1,    \
      I* out) {                                                                              \
    gtopk::DenseSrc<V> src;                                                                  \
    src.x = x;                                                                               \
    gtopk::radix_pass<V>(src, lay, lay, S, j, kbits, wbits, st, hist, ctr, cand0, cand1,     \
                         out);                                                               \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(GTOPK_THREADS) gtopk_thr_count_##VS##_##IS(   \
      const V::bits_t* x, const gtopk_i64* lay, int S, const gtopk_u64* thr, gtopk_u64* ctr, \
      I* out) {                                                                              \
    gtopk::collect_ge<V>(x, lay, S, thr, ctr + S, out, lay + 3 * (S + 1));                   \
  }

using gtopk::BF16;
using gtopk::F16;
using gtopk::F32;
using gtopk::F64;

GTOPK_SELECT_VALUE(f32, F32)
GTOPK_SELECT_VALUE(f64, F64)
GTOPK_SELECT_VALUE(f16, F16)
GTOPK_SELECT_VALUE(bf16, BF16)
GTOPK_SELECT_VALUE_INDEX(f32, F32, i32, int)
GTOPK_SELECT_VALUE_INDEX(f32, F32, i64, long long)
GTOPK_SELECT_VALUE_INDEX(f64, F64, i32, int)
GTOPK_SELECT_VALUE_INDEX(f64, F64, i64, long long)
GTOPK_SELECT_VALUE_INDEX(f16, F16, i32, int)
GTOPK_SELECT_VALUE_INDEX(f16, F16, i64, long long)
GTOPK_SELECT_VALUE_INDEX(bf16, BF16, i32, int)
GTOPK_SELECT_VALUE_INDEX(bf16, BF16, i64, long long)
