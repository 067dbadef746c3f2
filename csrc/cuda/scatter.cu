// Scatter of a sparse result into a dense buffer and the error-feedback
// residual update on CUDA; mirrors csrc/cpu/scatter.cpp.
//
// gtopk_fill2_*: one pass over the dense buffer writing both outputs of a
// step (the update's zeros and the residual's copy of acc); then
// gtopk_patch2_*: one launch over the sparse entries patching both (the
// sent entries of the residual: acc - sent; the result's entries of the
// update: vals / divisor).  scatter_update alone is zeros + gtopk_scatter_*,
// residual_update alone a copy + gtopk_residual_*.
//
// Arithmetic matches torch on CUDA (the reference run on a CUDA tensor) bit
// for bit: torch divides by a Python number as a multiplication by its
// reciprocal, (1 / divisor) rounded in the opmath type (float for fp16/bf16;
// aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu); acc - sent is one
// subtraction in opmath rounded to the value type.  Indices outside
// [0, numel) are skipped (every caller passes selected indices).
#include "common.cuh"

namespace gtopk {

template <class V>
__device__ __forceinline__ typename V::bits_t divide(typename V::bits_t v, gtopk_i64 divisor) {
  if (divisor == 1) return v;
  return V::from_op(V::mul(V::to_op(v), V::recip(divisor)));
}

template <class V>
__device__ __forceinline__ typename V::bits_t minus(typename V::bits_t a, typename V::bits_t b) {
  return V::from_op(V::sub(V::to_op(a), V::to_op(b)));
}

}  // namespace gtopk

#define GTOPK_SCATTER_VALUE(VS, V)                                                           \
  extern "C" __global__ void gtopk_fill2_##VS(const V::bits_t* acc, V::bits_t* upd,          \
                                              V::bits_t* res, gtopk_i64 n) {                 \
    const gtopk_i64 stride = static_cast<gtopk_i64>(gridDim.x) * blockDim.x;                 \
    for (gtopk_i64 i = static_cast<gtopk_i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; \
         i += stride) {                                                                      \
      upd[i] = 0;                                                                            \
      res[i] = acc[i];                                                                       \
    }                                                                                        \
  }

#define GTOPK_SCATTER_VALUE_INDEX(VS, V, IS, I)                                              \
  extern "C" __global__ void gtopk_scatter_##VS##_##IS(const I* idx, const V::bits_t* v,     \
                                                       gtopk_i64 n, gtopk_i64 divisor,       \
                                                       V::bits_t* out, gtopk_i64 numel) {    \
    const gtopk_i64 t = static_cast<gtopk_i64>(blockIdx.x) * blockDim.x + threadIdx.x;       \
    if (t >= n) return;                                                                      \
    const gtopk_i64 p = static_cast<gtopk_i64>(idx[t]);                                      \
    if (p >= 0 && p < numel) out[p] = gtopk::divide<V>(v[t], divisor);                       \
  }                                                                                          \
  extern "C" __global__ void gtopk_residual_##VS##_##IS(const V::bits_t* acc, const I* idx,  \
                                                        const V::bits_t* sent, gtopk_i64 n,  \
                                                        V::bits_t* res, gtopk_i64 numel) {   \
    const gtopk_i64 t = static_cast<gtopk_i64>(blockIdx.x) * blockDim.x + threadIdx.x;       \
    if (t >= n) return;                                                                      \
    const gtopk_i64 p = static_cast<gtopk_i64>(idx[t]);                                      \
    if (p >= 0 && p < numel) res[p] = gtopk::minus<V>(acc[p], sent[t]);                      \
  }                                                                                          \
  extern "C" __global__ void gtopk_patch2_##VS##_##IS(                                       \
      const V::bits_t* acc, const I* sidx, const V::bits_t* sent, gtopk_i64 ns,              \
      const I* idx, const V::bits_t* vals, gtopk_i64 n, gtopk_i64 divisor, V::bits_t* upd,   \
      V::bits_t* res, gtopk_i64 numel) {                                                     \
    const gtopk_i64 t = static_cast<gtopk_i64>(blockIdx.x) * blockDim.x + threadIdx.x;       \
    if (t < ns) {                                                                            \
      const gtopk_i64 p = static_cast<gtopk_i64>(sidx[t]);                                   \
      if (p >= 0 && p < numel) res[p] = gtopk::minus<V>(acc[p], sent[t]);                    \
    }                                                                                        \
    if (t < n) {                                                                             \
      const gtopk_i64 p = static_cast<gtopk_i64>(idx[t]);                                    \
      if (p >= 0 && p < numel) upd[p] = gtopk::divide<V>(vals[t], divisor);                  \
    }                                                                                        \
  }

using gtopk::BF16;
using gtopk::F16;
using gtopk::F32;
using gtopk::F64;

GTOPK_SCATTER_VALUE(f32, F32)
GTOPK_SCATTER_VALUE(f64, F64)
GTOPK_SCATTER_VALUE(f16, F16)
GTOPK_SCATTER_VALUE(bf16, BF16)
GTOPK_SCATTER_VALUE_INDEX(f32, F32, i32, int)
GTOPK_SCATTER_VALUE_INDEX(f32, F32, i64, long long)
GTOPK_SCATTER_VALUE_INDEX(f64, F64, i32, int)
GTOPK_SCATTER_VALUE_INDEX(f64, F64, i64, long long)
GTOPK_SCATTER_VALUE_INDEX(f16, F16, i32, int)
GTOPK_SCATTER_VALUE_INDEX(f16, F16, i64, long long)
GTOPK_SCATTER_VALUE_INDEX(bf16, BF16, i32, int)
GTOPK_SCATTER_VALUE_INDEX(bf16, BF16, i64, long long)
