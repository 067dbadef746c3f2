// Scatter of a sparse result into a dense buffer on CUDA; mirrors
// csrc/cpu/scatter.cpp.  scatter_update is torch's zeros + gtopk_scatter_*
// (one thread per sparse entry).
//
// Arithmetic matches torch on CUDA (the reference run on a CUDA tensor) bit
// for bit: torch divides by a Python number as a multiplication by its
// reciprocal, (1 / divisor) rounded in the opmath type (float for fp16/bf16;
// aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu).  Indices outside
// [0, numel) are skipped (every caller passes selected indices).
#include "common.cuh"

namespace gtopk {

template <class V>
__device__ __forceinline__ typename V::bits_t divide(typename V::bits_t v, gtopk_i64 divisor) {
  if (divisor == 1) return v;
  return V::from_op(V::mul(V::to_op(v), V::recip(divisor)));
}

}  // namespace gtopk

#define GTOPK_SCATTER_VALUE_INDEX(VS, V, IS, I)                                              \
  extern "C" __global__ void gtopk_scatter_##VS##_##IS(const I* idx, const V::bits_t* v,     \
                                                       gtopk_i64 n, gtopk_i64 divisor,       \
                                                       V::bits_t* out, gtopk_i64 numel) {    \
    const gtopk_i64 t = static_cast<gtopk_i64>(blockIdx.x) * blockDim.x + threadIdx.x;       \
    if (t >= n) return;                                                                      \
    const gtopk_i64 p = static_cast<gtopk_i64>(idx[t]);                                      \
    if (p >= 0 && p < numel) out[p] = gtopk::divide<V>(v[t], divisor);                       \
  }

using gtopk::BF16;
using gtopk::F16;
using gtopk::F32;
using gtopk::F64;

GTOPK_SCATTER_VALUE_INDEX(f32, F32, i32, int)
GTOPK_SCATTER_VALUE_INDEX(f32, F32, i64, long long)
GTOPK_SCATTER_VALUE_INDEX(f64, F64, i32, int)
GTOPK_SCATTER_VALUE_INDEX(f64, F64, i64, long long)
GTOPK_SCATTER_VALUE_INDEX(f16, F16, i32, int)
GTOPK_SCATTER_VALUE_INDEX(f16, F16, i64, long long)
GTOPK_SCATTER_VALUE_INDEX(bf16, BF16, i32, int)
GTOPK_SCATTER_VALUE_INDEX(bf16, BF16, i64, long long)
