// Error-feedback compensation and the reducer's in-place O(k) updates on
// CUDA; mirrors csrc/cpu/compensate.cpp (same operations, same results: the
// reference's, gtopk_plugin/kernels/reference.py, run on the same tensors).
//
//   gtopk_compensate_*      out = grad + residual (or grad), and "out all
//                           finite" (DESIGN.md §3; gTop-k paper, Algorithm 2,
//                           acc = grad + residual) in one pass;
//   gtopk_comp_sample_*,    the fused front of compensate_select_topk: the
//   gtopk_comp_collect_*    threshold sample of the sampled start (select.cu)
//                           taken from grad + residual computed on the fly,
//                           then ONE pass over every gradient and the residual
//                           that writes acc, raises a per-gradient non-finite
//                           flag and collects the positions at or above the
//                           sampled bound into the candidate buffer; the
//                           radix select (select.cu's passes) then starts
//                           from those candidates and never reads acc again
//                           unless the bound failed;
//   gtopk_subtract_at_*     acc[idx] -= sent (the residual made in place);
//   gtopk_zero_at_*         out[prev] = 0 (first half of scatter_reset_; the
//                           second is scatter.cu's gtopk_scatter_*);
//   gtopk_div_count_*       y = x / divisor (y may be x) and the nonzero count.
//
// Arithmetic is torch's on CUDA: one addition or subtraction per element in
// the opmath type (float for fp16/bf16), rounded to nearest-even into the
// storage type, with _rn intrinsics (no contraction, no folding of 0 + x);
// the division by a Python integer is a multiplication by the reciprocal
// rounded in opmath (BinaryDivTrueKernel.cu), as in scatter.cu.  Without a
// residual the gradient's bits are copied (NaN payloads, -0.0).
//
// Finiteness is the CPU kernel's, on the accumulator: an entry of
// grad + residual is non-finite iff its magnitude key (common.cuh) is the
// +inf key (Inf or NaN), which covers a non-finite gradient, a non-finite
// residual and a sum that overflowed (docs/design.md §3).  Flags are u32 per gradient,
// zeroed by the host and set to 1 by any block that saw such an entry.
#include "radix.cuh"
#include "sample.cuh"

#define GTOPK_COMP_ITEMS 8  // entries per thread of the plain elementwise kernels
// comp_collect is declared for 4 resident blocks (64 registers a thread):
// with the thread count alone ptxas held the fp64 variant to 32 registers
// and spilled.

namespace gtopk {

template <class V>
struct InfKey;
template <>
struct InfKey<F32> {
  static __device__ __forceinline__ gtopk_u64 value() { return 0x7F800000ull; }
};
template <>
struct InfKey<F64> {
  static __device__ __forceinline__ gtopk_u64 value() { return 0x7FF0000000000000ull; }
};
template <>
struct InfKey<F16> {
  static __device__ __forceinline__ gtopk_u64 value() { return 0x7C00ull; }
};
template <>
struct InfKey<BF16> {
  static __device__ __forceinline__ gtopk_u64 value() { return 0x7F80ull; }
};

template <class V>
__device__ __forceinline__ bool nonfinite(typename V::bits_t b) {
  return V::key(b) >= InfKey<V>::value();
}

// grad + residual[i] as torch.add computes it (r == nullptr: grad itself).
template <class V>
__device__ __forceinline__ typename V::bits_t comp(typename V::bits_t g,
                                                   const typename V::bits_t* r, gtopk_i64 i) {
  if (r == nullptr) return g;
  return V::from_op(V::add(V::to_op(g), V::to_op(r[i])));
}

// The gradients of compensate_select_topk, concatenated: gradient t fills
// acc[goff[t], goff[t + 1]) and lives at the device address gptr[t].
template <class V>
__device__ __forceinline__ typename V::bits_t grad_at(const gtopk_u64* gptr,
                                                      const gtopk_i64* goff, int t, gtopk_i64 i) {
  return reinterpret_cast<const typename V::bits_t*>(gptr[t])[i - goff[t]];
}

// The sample's key_at for compensate_select_topk: the key of acc[i] before
// acc is written (the same bits comp_collect writes there).
template <class V>
struct CompKey {
  const gtopk_u64* gptr;
  const gtopk_i64* goff;
  int T;
  const typename V::bits_t* r;
  __device__ __forceinline__ gtopk_u64 operator()(gtopk_i64 i) const {
    const int t = find_range(goff, T, i);
    return V::key(comp<V>(grad_at<V>(gptr, goff, t, i), r, i));
  }
};

template <class V>
__device__ __forceinline__ void compensate(const typename V::bits_t* g,
                                           const typename V::bits_t* r, gtopk_i64 n,
                                           typename V::bits_t* out, gtopk_u32* bad) {
  const gtopk_i64 first =
      static_cast<gtopk_i64>(blockIdx.x) * (GTOPK_THREADS * GTOPK_COMP_ITEMS) + threadIdx.x;
  int nf = 0;
  for (int m = 0; m < GTOPK_COMP_ITEMS; ++m) {
    const gtopk_i64 i = first + static_cast<gtopk_i64>(m) * GTOPK_THREADS;
    if (i >= n) break;
    const typename V::bits_t a = comp<V>(g[i], r, i);
    nf |= nonfinite<V>(a) ? 1 : 0;  // the sum: a residual's overflow too
    out[i] = a;
  }
  if (__syncthreads_or(nf) && threadIdx.x == 0) atomicOr(bad, 1u);
}

// One block per CHUNK entries of a segment (the select layout `lay`; the
// segments cover acc exactly, so every entry is written once).  Entries with
// key >= thr[s] go to the segment's candidate slots (counted in counter[s],
// written while they fit), as select.cu's collect_ge; thr == nullptr or
// thr[s] == ~0: compensation only.
template <class V>
__device__ __forceinline__ void comp_collect(const gtopk_u64* gptr, const gtopk_i64* goff, int T,
                                             const typename V::bits_t* r,
                                             typename V::bits_t* acc, const gtopk_i64* lay, int S,
                                             const gtopk_u64* thr, gtopk_u64* counter,
                                             gtopk_i64* cand, gtopk_u32* bad) {
  __shared__ gtopk_u64 sh_scan[32];
  __shared__ gtopk_i64 sh_base;
  const gtopk_i64* seg = lay;
  const gtopk_i64* blk = lay + (S + 1);
  const gtopk_i64* cap = lay + 2 * (S + 1);
  const int tid = threadIdx.x;
  const int s = find_range(blk, S, static_cast<gtopk_i64>(blockIdx.x));
  const gtopk_i64 c = static_cast<gtopk_i64>(blockIdx.x) - blk[s];
  const gtopk_i64 lo = seg[s], n = seg[s + 1] - lo;
  const gtopk_u64 t_thr = thr == nullptr ? ~0ull : thr[s];  // uniform per block
  const gtopk_i64 first = c * GTOPK_CHUNK + tid;
  gtopk_u64 emask = 0ull;
  if (first < n) {
    // this thread's entries ascend: a cursor over the gradients, not a search each
    int t = find_range(goff, T, lo + first);
    const typename V::bits_t* gp = reinterpret_cast<const typename V::bits_t*>(gptr[t]);
    gtopk_i64 gbeg = goff[t], gend = goff[t + 1];
    int flagged = -1;  // one atomic per gradient and thread, even if all is NaN
    for (int m = 0; m < GTOPK_ITEMS; ++m) {
      const gtopk_i64 i = first + static_cast<gtopk_i64>(m) * GTOPK_THREADS;
      if (i >= n) break;
      const gtopk_i64 gi = lo + i;
      if (gi >= gend) {
        do {
          ++t;
        } while (gi >= goff[t + 1]);
        gp = reinterpret_cast<const typename V::bits_t*>(gptr[t]);
        gbeg = goff[t];
        gend = goff[t + 1];
      }
      const typename V::bits_t a = comp<V>(gp[gi - gbeg], r, gi);
      if (nonfinite<V>(a) && t != flagged) {
        atomicOr(&bad[t], 1u);
        flagged = t;
      }
      acc[gi] = a;
      if (V::key(a) >= t_thr) emask |= 1ull << m;
    }
  }
  if (t_thr == ~0ull) return;  // no candidates wanted for this segment
  const gtopk_u64 ne = static_cast<gtopk_u64>(__popcll(emask));
  gtopk_u64 tot;
  const gtopk_u64 excl = block_inclusive_scan(ne, sh_scan, &tot) - ne;
  if (tid == 0) sh_base = tot ? static_cast<gtopk_i64>(atomicAdd(&counter[s], tot)) : 0;
  __syncthreads();
  const gtopk_i64 cbase = cap[s], ccap = cap[s + 1] - cbase;
  gtopk_i64 e = sh_base + static_cast<gtopk_i64>(excl);
  for (gtopk_u64 mk = emask; mk; mk &= mk - 1ull) {
    const int m = __ffsll(static_cast<long long>(mk)) - 1;
    if (e < ccap) cand[cbase + e] = lo + first + static_cast<gtopk_i64>(m) * GTOPK_THREADS;
    ++e;
  }
}

template <class V>
__device__ __forceinline__ void div_count(const typename V::bits_t* x, typename V::bits_t* y,
                                          gtopk_i64 n, gtopk_i64 divisor, gtopk_u64* count) {
  __shared__ gtopk_u64 sh_scan[32];
  const gtopk_i64 first =
      static_cast<gtopk_i64>(blockIdx.x) * (GTOPK_THREADS * GTOPK_COMP_ITEMS) + threadIdx.x;
  const typename V::op_t inv = V::recip(divisor);
  gtopk_u64 cnt = 0ull;
  for (int m = 0; m < GTOPK_COMP_ITEMS; ++m) {
    const gtopk_i64 i = first + static_cast<gtopk_i64>(m) * GTOPK_THREADS;
    if (i >= n) break;
    typename V::bits_t b = x[i];
    if (divisor != 1) b = V::from_op(V::mul(V::to_op(b), inv));
    if (divisor != 1 || x != y) y[i] = b;
    cnt += V::key(b) != 0ull ? 1ull : 0ull;  // torch.count_nonzero: -0.0 is zero, NaN is not
  }
  gtopk_u64 tot;
  block_inclusive_scan(cnt, sh_scan, &tot);
  if (threadIdx.x == 0 && tot) atomicAdd(count, tot);
}

}  // namespace gtopk

#define GTOPK_COMPENSATE_VALUE(VS, V)                                                        \
  extern "C" __global__ void __launch_bounds__(GTOPK_THREADS) gtopk_compensate_##VS(         \
      const V::bits_t* g, const V::bits_t* r, gtopk_i64 n, V::bits_t* out, gtopk_u32* bad) { \
    gtopk::compensate<V>(g, r, n, out, bad);                                                 \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(GTOPK_THREADS) gtopk_comp_sample_##VS(        \
      const gtopk_u64* gptr, const gtopk_i64* goff, int T, const V::bits_t* r,               \
      const gtopk_i64* seg, const gtopk_i64* tpar, gtopk_u64* thr) {                         \
    gtopk::CompKey<V> key_at;                                                                \
    key_at.gptr = gptr;                                                                      \
    key_at.goff = goff;                                                                      \
    key_at.T = T;                                                                            \
    key_at.r = r;                                                                            \
    gtopk::sample_threshold(key_at, seg, tpar, thr);                                         \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(GTOPK_THREADS, 4) gtopk_comp_collect_##VS(    \
      const gtopk_u64* gptr, const gtopk_i64* goff, int T, const V::bits_t* r,               \
      V::bits_t* acc, const gtopk_i64* lay, int S, const gtopk_u64* thr, gtopk_u64* ctr,     \
      gtopk_i64* cand0, gtopk_u32* bad) {                                                    \
    gtopk::comp_collect<V>(gptr, goff, T, r, acc, lay, S, thr, ctr + 2 * S, cand0, bad);     \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(GTOPK_THREADS) gtopk_div_count_##VS(          \
      const V::bits_t* x, V::bits_t* y, gtopk_i64 n, gtopk_i64 divisor, gtopk_u64* count) {  \
    gtopk::div_count<V>(x, y, n, divisor, count);                                            \
  }

#define GTOPK_COMPENSATE_VALUE_INDEX(VS, V, IS, I)                                           \
  extern "C" __global__ void gtopk_subtract_at_##VS##_##IS(                                  \
      V::bits_t* acc, const I* idx, const V::bits_t* sent, gtopk_i64 n, gtopk_i64 numel) {   \
    const gtopk_i64 t = static_cast<gtopk_i64>(blockIdx.x) * blockDim.x + threadIdx.x;       \
    if (t >= n) return;                                                                      \
    const gtopk_i64 p = static_cast<gtopk_i64>(idx[t]);                                      \
    if (p >= 0 && p < numel)                                                                 \
      acc[p] = V::from_op(V::sub(V::to_op(acc[p]), V::to_op(sent[t])));                     \
  }                                                                                          \
  extern "C" __global__ void gtopk_zero_at_##VS##_##IS(const I* idx, gtopk_i64 n,            \
                                                       V::bits_t* out, gtopk_i64 numel) {    \
    const gtopk_i64 t = static_cast<gtopk_i64>(blockIdx.x) * blockDim.x + threadIdx.x;       \
    if (t >= n) return;                                                                      \
    const gtopk_i64 p = static_cast<gtopk_i64>(idx[t]);                                      \
    if (p >= 0 && p < numel) out[p] = static_cast<V::bits_t>(0);                             \
  }

using gtopk::BF16;
using gtopk::F16;
using gtopk::F32;
using gtopk::F64;

GTOPK_COMPENSATE_VALUE(f32, F32)
GTOPK_COMPENSATE_VALUE(f64, F64)
GTOPK_COMPENSATE_VALUE(f16, F16)
GTOPK_COMPENSATE_VALUE(bf16, BF16)
GTOPK_COMPENSATE_VALUE_INDEX(f32, F32, i32, int)
GTOPK_COMPENSATE_VALUE_INDEX(f32, F32, i64, long long)
GTOPK_COMPENSATE_VALUE_INDEX(f64, F64, i32, int)
GTOPK_COMPENSATE_VALUE_INDEX(f64, F64, i64, long long)
GTOPK_COMPENSATE_VALUE_INDEX(f16, F16, i32, int)
GTOPK_COMPENSATE_VALUE_INDEX(f16, F16, i64, long long)
GTOPK_COMPENSATE_VALUE_INDEX(bf16, BF16, i32, int)
GTOPK_COMPENSATE_VALUE_INDEX(bf16, BF16, i64, long long)
