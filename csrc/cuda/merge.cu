// Merge-and-select of two sparse sets (one gTop-k butterfly round) on CUDA;
// mirrors csrc/cpu/merge.cpp.
//
// Operands: ascending, unique global indices with values (cuda.py checks
// and sends anything else to the reference).  Steps:
//   1. gtopk_merge_bounds_*: each operand's range in every segment (binary
//      searches of the segment boundaries; the host reads them once, which
//      also checks that every index lies inside the segments);
//   2. gtopk_merge_union_*: the union as arrays (index, value, valid), laid
//      out per segment as [operand a's entries | operand b's entries]; a b
//      entry whose index is also in a is folded into a's entry and marked
//      invalid.  Values are summed as the reference's index_add_ does: zeros
//      + a, then + b, each addition rounded to the value dtype (so a lone
//      -0.0 becomes +0.0; two-operand IEEE addition commutes, so both
//      partners of a round get the same bits);
//   3. the radix select of radix.cuh over the union (gtopk_merge_pass_*),
//      per segment the top-k by (|value| desc, index asc);
//   4. gtopk_merge_finish_*: the selected entries' indices and values, and a
//      flag per union entry; gtopk_merge_keep: keep_a / keep_b, whether each
//      operand entry's index is in the result (exact error feedback).
// The host sorts the result by index.
#include "radix.cuh"

#define GTOPK_MERGE_INDEX(IS, I)                                                             \
  extern "C" __global__ void gtopk_merge_bounds_##IS(const I* ia, gtopk_i64 na, const I* ib, \
                                                     gtopk_i64 nb, const gtopk_i64* offsets, \
                                                     int S, gtopk_i64* bnd) {                \
    const gtopk_i64 t = static_cast<gtopk_i64>(blockIdx.x) * blockDim.x + threadIdx.x;       \
    if (t <= S) {                                                                            \
      bnd[t] = gtopk::lower_bound(ia, na, offsets[t]);                                       \
    } else if (t <= 2 * S + 1) {                                                             \
      bnd[t] = gtopk::lower_bound(ib, nb, offsets[t - (S + 1)]);                             \
    }                                                                                        \
  }

namespace gtopk {

// zeros + v, rounded to the value dtype (-0.0 -> +0.0)
template <class V>
__device__ __forceinline__ typename V::bits_t add0(typename V::bits_t v) {
  return V::from_op(V::add(static_cast<typename V::op_t>(0), V::to_op(v)));
}

template <class V, typename I>
__device__ __forceinline__ void merge_union(const I* ia, const typename V::bits_t* va,
                                            gtopk_i64 na, const I* ib,
                                            const typename V::bits_t* vb, gtopk_i64 nb,
                                            const gtopk_i64* bnd, int S, gtopk_i64* uidx,
                                            typename V::bits_t* uval, unsigned char* uvalid,
                                            gtopk_i64* posa, gtopk_i64* posb) {
  const gtopk_i64 u = static_cast<gtopk_i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (u >= na + nb) return;
  const gtopk_i64* ab = bnd;
  const gtopk_i64* bb = bnd + (S + 1);
  if (u < na) {
    const gtopk_i64 i = u;
    const int s = find_range(ab, S, i);
    const gtopk_i64 p = i + bb[s];
    const gtopk_i64 key = static_cast<gtopk_i64>(ia[i]);
    const gtopk_i64 j = lower_bound(ib, nb, key);
    typename V::bits_t sum = add0<V>(va[i]);
    if (j < nb && static_cast<gtopk_i64>(ib[j]) == key)
      sum = V::from_op(V::add(V::to_op(sum), V::to_op(vb[j])));
    uidx[p] = key;
    uval[p] = sum;
    uvalid[p] = 1;
    posa[i] = p;
  } else {
    const gtopk_i64 j = u - na;
    const int s = find_range(bb, S, j);
    const gtopk_i64 p = ab[s + 1] + j;
    const gtopk_i64 key = static_cast<gtopk_i64>(ib[j]);
    const gtopk_i64 i = lower_bound(ia, na, key);
    const bool dup = i < na && static_cast<gtopk_i64>(ia[i]) == key;
    uidx[p] = key;
    uval[p] = add0<V>(vb[j]);
    uvalid[p] = dup ? 0 : 1;
    posb[j] = dup ? i + bb[s] : p;  // a duplicate shares its twin's fate
  }
}

template <class V, typename I>
__device__ __forceinline__ void merge_finish(const gtopk_i64* slots, gtopk_i64 nslots,
                                             const gtopk_i64* uidx,
                                             const typename V::bits_t* uval, unsigned char* sel,
                                             I* oidx, typename V::bits_t* oval) {
  const gtopk_i64 t = static_cast<gtopk_i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= nslots) return;
  const gtopk_i64 p = slots[t];
  if (p == GTOPK_I64_MAX) {  // an unused slot: sorts last, cut off on the host
    oidx[t] = IndexMax<I>::value();
    oval[t] = 0;
  } else {
    sel[p] = 1;
    oidx[t] = static_cast<I>(uidx[p]);
    oval[t] = uval[p];
  }
}

}  // namespace gtopk

extern "C" __global__ void gtopk_merge_keep(const gtopk_i64* posa, gtopk_i64 na,
                                            const gtopk_i64* posb, gtopk_i64 nb,
                                            const unsigned char* sel, unsigned char* keep_a,
                                            unsigned char* keep_b) {
  const gtopk_i64 t = static_cast<gtopk_i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < na) {
    keep_a[t] = sel[posa[t]];
  } else if (t < na + nb) {
    keep_b[t - na] = sel[posb[t - na]];
  }
}

#define GTOPK_MERGE_VALUE(VS, V)                                                             \
  extern "C" __global__ void __launch_bounds__(GTOPK_THREADS) gtopk_merge_pass_##VS(         \
      const V::bits_t* uval, const gtopk_i64* uidx, const unsigned char* uvalid,             \
      const gtopk_i64* lay, const gtopk_i64* offsets, int S, int j, int kbits, int wbits,    \
      gtopk_i64* st, gtopk_u64* hist, gtopk_u64* ctr, gtopk_i64* cand0, gtopk_i64* cand1,    \
      gtopk_i64* out) {                                                                      \
    gtopk::UnionSrc<V> src;                                                                  \
    src.val = uval;                                                                          \
    src.idx = uidx;                                                                          \
    src.valid = uvalid;                                                                      \
    gtopk::radix_pass<V>(src, lay, offsets, S, j, kbits, wbits, st, hist, ctr, cand0, cand1, \
                         out);                                                               \
  }

#define GTOPK_MERGE_VALUE_INDEX(VS, V, IS, I)                                                \
  extern "C" __global__ void gtopk_merge_union_##VS##_##IS(                                  \
      const I* ia, const V::bits_t* va, gtopk_i64 na, const I* ib, const V::bits_t* vb,      \
      gtopk_i64 nb, const gtopk_i64* bnd, int S, gtopk_i64* uidx, V::bits_t* uval,           \
      unsigned char* uvalid, gtopk_i64* posa, gtopk_i64* posb) {                             \
    gtopk::merge_union<V>(ia, va, na, ib, vb, nb, bnd, S, uidx, uval, uvalid, posa, posb);   \
  }                                                                                          \
  extern "C" __global__ void gtopk_merge_finish_##VS##_##IS(                                 \
      const gtopk_i64* slots, gtopk_i64 nslots, const gtopk_i64* uidx, const V::bits_t* uval, \
      unsigned char* sel, I* oidx, V::bits_t* oval) {                                        \
    gtopk::merge_finish<V>(slots, nslots, uidx, uval, sel, oidx, oval);                      \
  }

using gtopk::BF16;
using gtopk::F16;
using gtopk::F32;
using gtopk::F64;

GTOPK_MERGE_INDEX(i32, int)
GTOPK_MERGE_INDEX(i64, long long)
GTOPK_MERGE_VALUE(f32, F32)
GTOPK_MERGE_VALUE(f64, F64)
GTOPK_MERGE_VALUE(f16, F16)
GTOPK_MERGE_VALUE(bf16, BF16)
GTOPK_MERGE_VALUE_INDEX(f32, F32, i32, int)
GTOPK_MERGE_VALUE_INDEX(f32, F32, i64, long long)
GTOPK_MERGE_VALUE_INDEX(f64, F64, i32, int)
GTOPK_MERGE_VALUE_INDEX(f64, F64, i64, long long)
GTOPK_MERGE_VALUE_INDEX(f16, F16, i32, int)
GTOPK_MERGE_VALUE_INDEX(f16, F16, i64, long long)
GTOPK_MERGE_VALUE_INDEX(bf16, BF16, i32, int)
GTOPK_MERGE_VALUE_INDEX(bf16, BF16, i64, long long)
