// Shared pieces of the CUDA kernels (csrc/cuda); mirrors csrc/cpu/common.h.
//
// Self-contained on purpose: no standard or CUDA toolkit headers, so every
// file compiles both under NVRTC (cupy.RawModule, which has no host headers)
// and under nvcc (the compile check of tests/test_kernels_cuda.py).
// gtopk_plugin/kernels/cuda.py pastes this file in place of its #include
// line before handing a source to NVRTC (CuPy's compile cache keys on the
// source text, so an edited header can never be served stale).
//
// Ordering (DESIGN.md §3): larger |value| first, then smaller index.  Every
// comparison of magnitudes goes through an unsigned integer *key*: the bits
// of |x| (sign cleared), which order exactly like the magnitudes (-0.0 ==
// +0.0, denormals included); NaN keys are clamped to the +inf key, so NaN
// ranks as +inf, as in the pure-torch reference.
//
// Value types travel as their storage bits (uint16 for fp16/bf16), so no
// cuda_fp16.h is needed: conversions are one PTX instruction (fp16) or a bit
// shift / the c10 rounding rule (bf16).  Arithmetic is done the way torch
// does it on CUDA: in the "opmath" type (float for fp16/bf16), each result
// rounded to nearest-even into the storage type, with the _rn intrinsics (no
// contraction into FMAs, no folding of 0 + x into x: -0.0 must become +0.0).
#pragma once

typedef unsigned short gtopk_u16;
typedef unsigned int gtopk_u32;
typedef unsigned long long gtopk_u64;
typedef long long gtopk_i64;

#define GTOPK_I64_MAX 0x7FFFFFFFFFFFFFFFLL
#define GTOPK_I32_MAX 0x7FFFFFFF

namespace gtopk {

// ---------------------------------------------------------------------------
// Value traits: storage bits, magnitude key, opmath conversions.

struct F32 {
  typedef gtopk_u32 bits_t;
  typedef float op_t;
  static const int kBits = 31;  // significant key bits (the sign bit is cleared)
  static __device__ __forceinline__ gtopk_u64 key(bits_t b) {
    const gtopk_u32 m = b & 0x7FFFFFFFu;
    return m < 0x7F800000u ? m : 0x7F800000u;
  }
  static __device__ __forceinline__ op_t to_op(bits_t b) { return __uint_as_float(b); }
  static __device__ __forceinline__ bits_t from_op(op_t v) { return __float_as_uint(v); }
  static __device__ __forceinline__ op_t add(op_t a, op_t b) { return __fadd_rn(a, b); }
  static __device__ __forceinline__ op_t sub(op_t a, op_t b) { return __fsub_rn(a, b); }
  static __device__ __forceinline__ op_t mul(op_t a, op_t b) { return __fmul_rn(a, b); }
  static __device__ __forceinline__ op_t recip(gtopk_i64 d) {
    return __fdiv_rn(1.0f, static_cast<float>(d));
  }
};

struct F64 {
  typedef gtopk_u64 bits_t;
  typedef double op_t;
  static const int kBits = 63;
  static __device__ __forceinline__ gtopk_u64 key(bits_t b) {
    const gtopk_u64 m = b & 0x7FFFFFFFFFFFFFFFull;
    return m < 0x7FF0000000000000ull ? m : 0x7FF0000000000000ull;
  }
  static __device__ __forceinline__ op_t to_op(bits_t b) {
    return __longlong_as_double(static_cast<gtopk_i64>(b));
  }
  static __device__ __forceinline__ bits_t from_op(op_t v) {
    return static_cast<gtopk_u64>(__double_as_longlong(v));
  }
  static __device__ __forceinline__ op_t add(op_t a, op_t b) { return __dadd_rn(a, b); }
  static __device__ __forceinline__ op_t sub(op_t a, op_t b) { return __dsub_rn(a, b); }
  static __device__ __forceinline__ op_t mul(op_t a, op_t b) { return __dmul_rn(a, b); }
  static __device__ __forceinline__ op_t recip(gtopk_i64 d) {
    return __ddiv_rn(1.0, static_cast<double>(d));
  }
};

struct F16 {
  typedef gtopk_u16 bits_t;
  typedef float op_t;
  static const int kBits = 15;
  static __device__ __forceinline__ gtopk_u64 key(bits_t b) {
    const gtopk_u32 m = b & 0x7FFFu;
    return m < 0x7C00u ? m : 0x7C00u;
  }
  static __device__ __forceinline__ op_t to_op(bits_t b) {
#ifdef CUDA_EXECUTOR_CPU  // the CPU executor (cuda_executor/): no PTX there
    return __half2float(__ushort_as_half(b));
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
    return f;
#endif
  }
  static __device__ __forceinline__ bits_t from_op(op_t v) {
#ifdef CUDA_EXECUTOR_CPU
    return __half_as_ushort(__float2half_rn(v));
#else
    gtopk_u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
#endif
  }
  static __device__ __forceinline__ op_t add(op_t a, op_t b) { return __fadd_rn(a, b); }
  static __device__ __forceinline__ op_t sub(op_t a, op_t b) { return __fsub_rn(a, b); }
  static __device__ __forceinline__ op_t mul(op_t a, op_t b) { return __fmul_rn(a, b); }
  static __device__ __forceinline__ op_t recip(gtopk_i64 d) {
    return __fdiv_rn(1.0f, static_cast<float>(d));
  }
};

struct BF16 {
  typedef gtopk_u16 bits_t;
  typedef float op_t;
  static const int kBits = 15;
  static __device__ __forceinline__ gtopk_u64 key(bits_t b) {
    const gtopk_u32 m = b & 0x7FFFu;
    return m < 0x7F80u ? m : 0x7F80u;
  }
  static __device__ __forceinline__ op_t to_op(bits_t b) {
    return __uint_as_float(static_cast<gtopk_u32>(b) << 16);
  }
  // Round to nearest even (c10::BFloat16's rule; NaN -> the quiet NaN 0x7FC0).
  static __device__ __forceinline__ bits_t from_op(op_t v) {
    gtopk_u32 u = __float_as_uint(v);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<gtopk_u16>(0x7FC0u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return static_cast<gtopk_u16>(u >> 16);
  }
  static __device__ __forceinline__ op_t add(op_t a, op_t b) { return __fadd_rn(a, b); }
  static __device__ __forceinline__ op_t sub(op_t a, op_t b) { return __fsub_rn(a, b); }
  static __device__ __forceinline__ op_t mul(op_t a, op_t b) { return __fmul_rn(a, b); }
  static __device__ __forceinline__ op_t recip(gtopk_i64 d) {
    return __fdiv_rn(1.0f, static_cast<float>(d));
  }
};

// Largest value of an index type: the "empty slot" sentinel of the outputs
// that are sorted on the host (no valid index reaches it: buffers addressed
// by int32 indices have at most 2^31 - 1 elements).
template <typename I>
struct IndexMax;
template <>
struct IndexMax<int> {
  static __device__ __forceinline__ int value() { return GTOPK_I32_MAX; }
};
template <>
struct IndexMax<long long> {
  static __device__ __forceinline__ long long value() { return GTOPK_I64_MAX; }
};

// ---------------------------------------------------------------------------
// Small device helpers.

// First position p in [0, n) with a[p] >= v (n if none); a ascending.
template <typename T>
__device__ __forceinline__ gtopk_i64 lower_bound(const T* a, gtopk_i64 n, gtopk_i64 v) {
  gtopk_i64 lo = 0, hi = n;
  while (lo < hi) {
    const gtopk_i64 mid = lo + ((hi - lo) >> 1);
    if (static_cast<gtopk_i64>(a[mid]) < v) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The s with a[s] <= v < a[s + 1], for a non-decreasing a[0..S] with
// a[0] <= v < a[S] (empty ranges, a[s] == a[s + 1], are skipped).
__device__ __forceinline__ int find_range(const gtopk_i64* a, int S, gtopk_i64 v) {
  int lo = 0, hi = S;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int mid = lo + ((hi - lo) >> 1);
    if (a[mid] <= v) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Inclusive prefix sum over the threads of a block (blockDim.x a multiple of
// 32, at most 1024) in thread order; *total receives the block's sum.
// `scratch` is __shared__ space for 32 values.  Every thread must call it.
__device__ __forceinline__ gtopk_u64 block_inclusive_scan(gtopk_u64 v, gtopk_u64* scratch,
                                                          gtopk_u64* total) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int o = 1; o < 32; o <<= 1) {
    const gtopk_u64 u = __shfl_up_sync(0xFFFFFFFFu, v, o);
    if (lane >= o) v += u;
  }
  if (lane == 31) scratch[wid] = v;
  __syncthreads();
  if (wid == 0) {
    gtopk_u64 w = lane < nw ? scratch[lane] : 0ull;
    for (int o = 1; o < 32; o <<= 1) {
      const gtopk_u64 u = __shfl_up_sync(0xFFFFFFFFu, w, o);
      if (lane >= o) w += u;
    }
    if (lane < nw) scratch[lane] = w;
  }
  __syncthreads();
  if (wid > 0) v += scratch[wid - 1];
  *total = scratch[nw - 1];
  __syncthreads();  // scratch may be reused right after
  return v;
}

}  // namespace gtopk
