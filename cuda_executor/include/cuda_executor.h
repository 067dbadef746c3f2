// The CUDA surface of csrc/cuda for the CPU executor (cuda_executor/).
//
// Force-included (g++ -include) into every kernel module the executor
// builds: thread and block indices, __shared__ memory, barriers, 32-lane
// warp collectives with _sync masks, atomics, fences, the _rn intrinsics
// and fp16/bf16 conversions.  Everything that synchronises or inspects
// threads is a call into the runtime (src/runtime.cpp), which runs the
// threads of a block as fibers and checks every shared and global access
// the compiler's thread-sanitizer instrumentation reports to it (no
// sanitizer library is linked: the runtime implements the __tsan_* hooks).
//
// __shared__ declarations are rewritten by the loader (cuda_executor/
// _build.py) into static boxes followed by a redzone, each announced to the
// runtime when first executed (cuda_exec_shared_decl), so it can poison
// them at block start and tell shared from global addresses; extern
// __shared__ arrays become pointers to the launch's dynamic shared memory.
#pragma once

#include <cstddef>
#include <cstring>
#include <type_traits>
#include <utility>

#define CUDA_EXECUTOR_CPU 1

// ---------------------------------------------------------------------------
// Qualifiers.  Kernels are found by the loader as `extern "C"` definitions
// carrying exactly this attribute list (see _build.py).
#define __global__ __attribute__((used, noinline))
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define CUDA_EXEC_SHARED_ATTR __attribute__((aligned(16)))
// A declaration the loader did not rewrite (an unusual spelling) is an error:
// the runtime would not know the variable is shared.
#define __shared__ _Pragma("GCC error \"cuda_executor: this __shared__ declaration was not rewritten (one declaration per line: __shared__ T name[N];)\"")
#define CUDA_EXEC_REDZONE 64
// Code the sanitizer instrumentation must not see (the runtime's own view
// of memory: atomics, argument unpacking).
#define CUDA_EXEC_NOSAN __attribute__((no_sanitize("thread"), noinline))

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
};

extern "C" {
// Built-in variables of the running thread.
uint3 cuda_exec_thread_idx(void);
uint3 cuda_exec_block_idx(void);
dim3 cuda_exec_block_dim(void);
dim3 cuda_exec_grid_dim(void);
// Barriers (a thread waits until every thread of its block arrives);
// `line` names the call site (the compiler may duplicate a call, so the
// code address does not).  kind: 0 plain, 1 or, 2 and, 3 count.
int cuda_exec_barrier(int kind, int pred, int line);
// Warp collectives: every lane named in `mask` must call the same one.
unsigned long long cuda_exec_warp(int op, unsigned mask, unsigned long long v, int arg, int width,
                                  void* pc, int line);
unsigned cuda_exec_activemask(void);
// Fences: __threadfence publishes this thread's earlier accesses to a later
// atomic of its block (release) and makes what an earlier atomic of its
// block observed visible to this thread (acquire).
void __threadfence(void);
void __threadfence_block(void);
void __threadfence_system(void);
// Recorded before the read-modify-write of an atomic (never preempts).
void cuda_exec_atomic_note(void* p, unsigned size, void* pc);
// Shared memory: a rewritten declaration, and the dynamic area.
void cuda_exec_shared_decl(void* box, size_t size, size_t box_size);
void* cuda_exec_dynamic_shared(void);
}

#define __syncthreads() ((void)::cuda_exec_barrier(0, 0, __LINE__))
#define __syncthreads_or(p) ::cuda_exec_barrier(1, (p), __LINE__)
#define __syncthreads_and(p) ::cuda_exec_barrier(2, (p), __LINE__)
#define __syncthreads_count(p) ::cuda_exec_barrier(3, (p), __LINE__)
#define threadIdx (::cuda_exec_thread_idx())
#define blockIdx (::cuda_exec_block_idx())
#define blockDim (::cuda_exec_block_dim())
#define gridDim (::cuda_exec_grid_dim())
#define warpSize 32

// ---------------------------------------------------------------------------
// Bit casts and the round-to-nearest intrinsics (compiled with
// -ffp-contract=off: no FMA contraction, as the _rn forms promise).
namespace cuda_exec_detail {
template <class To, class From>
inline To bit_cast(From v) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast of different sizes");
  return __builtin_bit_cast(To, v);
}
}  // namespace cuda_exec_detail

inline float __uint_as_float(unsigned int u) { return cuda_exec_detail::bit_cast<float>(u); }
inline unsigned int __float_as_uint(float f) { return cuda_exec_detail::bit_cast<unsigned int>(f); }
inline float __int_as_float(int u) { return cuda_exec_detail::bit_cast<float>(u); }
inline int __float_as_int(float f) { return cuda_exec_detail::bit_cast<int>(f); }
inline double __longlong_as_double(long long u) { return cuda_exec_detail::bit_cast<double>(u); }
inline long long __double_as_longlong(double d) { return cuda_exec_detail::bit_cast<long long>(d); }

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __fma_rn(double a, double b, double c) { return __builtin_fma(a, b, c); }

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x ? __builtin_clz(static_cast<unsigned>(x)) : 32; }
inline int __clzll(long long x) {
  return x ? __builtin_clzll(static_cast<unsigned long long>(x)) : 64;
}

// ---------------------------------------------------------------------------
// fp16 and bf16 (storage types and conversions, cuda_fp16.h / cuda_bf16.h
// spelling; round to nearest even, NaN -> the canonical NaN 0x7FFF).
struct __half {
  unsigned short __x;
};
struct __nv_bfloat16 {
  unsigned short __x;
};

inline __half __ushort_as_half(unsigned short b) {
  __half h;
  h.__x = b;
  return h;
}
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) {
  __nv_bfloat16 h;
  h.__x = b;
  return h;
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }

inline float __half2float(__half h) {
  const unsigned int b = h.__x;
  const unsigned int s = (b & 0x8000u) << 16;
  unsigned int e = (b >> 10) & 0x1Fu, m = b & 0x3FFu;
  if (e == 0x1Fu) return __uint_as_float(s | 0x7F800000u | (m << 13));
  if (e == 0) {
    if (m == 0) return __uint_as_float(s);
    int k = 0;  // subnormal: normalise
    while (!(m & 0x400u)) {
      m <<= 1;
      ++k;
    }
    return __uint_as_float(s | (static_cast<unsigned>(113 - k) << 23) | ((m & 0x3FFu) << 13));
  }
  return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
}

inline __half __float2half_rn(float f) {
  const unsigned int x = __float_as_uint(f);
  const unsigned short s = static_cast<unsigned short>((x >> 16) & 0x8000u);
  const unsigned int a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return __ushort_as_half(0x7FFF);
  if (a >= 0x477FF000u) return __ushort_as_half(s | 0x7C00u);  // rounds to (or is) infinity
  unsigned int q, rem, half;
  if (a < 0x38800000u) {  // a half subnormal (or zero): units of 2^-24
    if (a < 0x33000000u) return __ushort_as_half(s);
    const unsigned int e = a >> 23, m = (a & 0x7FFFFFu) | 0x800000u, sh = 126u - e;
    q = m >> sh;
    rem = m & ((1u << sh) - 1u);
    half = 1u << (sh - 1u);
  } else {
    const unsigned int r = a - 0x38000000u;  // rebias the exponent
    q = r >> 13;
    rem = r & 0x1FFFu;
    half = 0x1000u;
  }
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return __ushort_as_half(static_cast<unsigned short>(s | q));
}

inline float __bfloat162float(__nv_bfloat16 h) {
  return __uint_as_float(static_cast<unsigned int>(h.__x) << 16);
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return __ushort_as_bfloat16(0x7FFF);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return __ushort_as_bfloat16(static_cast<unsigned short>(u >> 16));
}

// ---------------------------------------------------------------------------
// Warp collectives.
namespace cuda_exec_detail {
enum { W_SYNC = 0, W_IDX = 1, W_UP = 2, W_DOWN = 3, W_XOR = 4, W_BALLOT = 5, W_ANY = 6, W_ALL = 7 };
template <class T>
inline unsigned long long to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of this type");
  unsigned long long b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T>
inline T from_bits(unsigned long long b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}
}  // namespace cuda_exec_detail

#define CUDA_EXEC_WARP(op, mask, v, arg, width) \
  ::cuda_exec_warp(op, mask, v, arg, width, __builtin_return_address(0), line)

namespace cuda_exec_detail {
template <class T>
__attribute__((noinline)) T shfl(int line, unsigned mask, T v, int src, int width = 32) {
  return from_bits<T>(CUDA_EXEC_WARP(W_IDX, mask, to_bits(v), src, width));
}
template <class T>
__attribute__((noinline)) T shfl_up(int line, unsigned mask, T v, unsigned int delta,
                                    int width = 32) {
  return from_bits<T>(CUDA_EXEC_WARP(W_UP, mask, to_bits(v), static_cast<int>(delta), width));
}
template <class T>
__attribute__((noinline)) T shfl_down(int line, unsigned mask, T v, unsigned int delta,
                                      int width = 32) {
  return from_bits<T>(CUDA_EXEC_WARP(W_DOWN, mask, to_bits(v), static_cast<int>(delta), width));
}
template <class T>
__attribute__((noinline)) T shfl_xor(int line, unsigned mask, T v, int lane_mask, int width = 32) {
  return from_bits<T>(CUDA_EXEC_WARP(W_XOR, mask, to_bits(v), lane_mask, width));
}
__attribute__((noinline)) inline unsigned long long vote(int line, int op, unsigned mask, int pred) {
  return CUDA_EXEC_WARP(op, mask, pred != 0, 0, 32);
}
struct SyncWarp {  // __syncwarp(mask = all lanes), called at source line `line`
  int line;
  __attribute__((noinline)) void operator()(unsigned mask = 0xFFFFFFFFu) const {
    CUDA_EXEC_WARP(W_SYNC, mask, 0, 0, 32);
  }
};
}  // namespace cuda_exec_detail

#define __shfl_sync(...) ::cuda_exec_detail::shfl(__LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) ::cuda_exec_detail::shfl_up(__LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) ::cuda_exec_detail::shfl_down(__LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) ::cuda_exec_detail::shfl_xor(__LINE__, __VA_ARGS__)
#define __ballot_sync(mask, pred) \
  static_cast<unsigned>(::cuda_exec_detail::vote(__LINE__, cuda_exec_detail::W_BALLOT, mask, pred))
#define __any_sync(mask, pred) \
  static_cast<int>(::cuda_exec_detail::vote(__LINE__, cuda_exec_detail::W_ANY, mask, pred))
#define __all_sync(mask, pred) \
  static_cast<int>(::cuda_exec_detail::vote(__LINE__, cuda_exec_detail::W_ALL, mask, pred))
#define __syncwarp(...) (::cuda_exec_detail::SyncWarp{__LINE__}(__VA_ARGS__))
inline unsigned __activemask() { return cuda_exec_activemask(); }

// ---------------------------------------------------------------------------
// Atomics: the runtime records the access (and its release/acquire effect),
// then the read-modify-write runs uninstrumented; fibers never switch inside
// it, so it is atomic.
#define CUDA_EXEC_RMW(NAME, T, EXPR)                                 \
  CUDA_EXEC_NOSAN inline T NAME(T* p, T v) {                         \
    ::cuda_exec_atomic_note(p, sizeof(T), __builtin_return_address(0)); \
    const T old = *p;                                                \
    *p = (EXPR);                                                     \
    return old;                                                      \
  }
#define CUDA_EXEC_RMW_INT(T)                                 \
  CUDA_EXEC_RMW(atomicAdd, T, old + v)                       \
  CUDA_EXEC_RMW(atomicSub, T, old - v)                       \
  CUDA_EXEC_RMW(atomicExch, T, v)                            \
  CUDA_EXEC_RMW(atomicMin, T, v < old ? v : old)             \
  CUDA_EXEC_RMW(atomicMax, T, v > old ? v : old)             \
  CUDA_EXEC_RMW(atomicAnd, T, old & v)                       \
  CUDA_EXEC_RMW(atomicOr, T, old | v)                        \
  CUDA_EXEC_RMW(atomicXor, T, old ^ v)                       \
  CUDA_EXEC_NOSAN inline T atomicCAS(T* p, T cmp, T v) {     \
    ::cuda_exec_atomic_note(p, sizeof(T), __builtin_return_address(0)); \
    const T old = *p;                                        \
    if (old == cmp) *p = v;                                  \
    return old;                                              \
  }
CUDA_EXEC_RMW_INT(int)
CUDA_EXEC_RMW_INT(unsigned int)
CUDA_EXEC_RMW_INT(unsigned long long)
CUDA_EXEC_RMW(atomicAdd, float, old + v)
CUDA_EXEC_RMW(atomicAdd, double, old + v)
CUDA_EXEC_RMW(atomicExch, float, v)
#undef CUDA_EXEC_RMW_INT
#undef CUDA_EXEC_RMW

// ---------------------------------------------------------------------------
// Kernel registration (the loader appends a table of entry(&kernel, "name")
// to the preprocessed source): an untyped invoker and the parameter sizes
// and kinds, checked against the arguments of every launch.
namespace cuda_exec {
struct Entry {
  const char* name;
  void* fn;
  void (*invoke)(void* fn, void** args);
  unsigned nparams;
  const unsigned* sizes;
  const char* kinds;  // 'p' pointer, 'i' integer, 'f' floating point, 'o' other
};
struct ModuleInfo {
  unsigned version;
  unsigned nkernels;
  const Entry* kernels;
};
template <class T>
struct Kind {
  static const char value = std::is_pointer<T>::value             ? 'p'
                            : std::is_integral<T>::value          ? 'i'
                            : std::is_floating_point<T>::value    ? 'f'
                                                                  : 'o';
};
template <class... A>
struct Sig {
  static constexpr unsigned sizes[sizeof...(A) + 1] = {static_cast<unsigned>(sizeof(A))..., 0u};
  static constexpr char kinds[sizeof...(A) + 1] = {Kind<A>::value..., 0};
  template <std::size_t... I>
  CUDA_EXEC_NOSAN static void call(void* f, void** a, std::index_sequence<I...>) {
    reinterpret_cast<void (*)(A...)>(f)(*static_cast<A*>(a[I])...);
  }
  CUDA_EXEC_NOSAN static void invoke(void* f, void** a) {
    call(f, a, std::index_sequence_for<A...>{});
  }
};
template <class... A>
constexpr unsigned Sig<A...>::sizes[sizeof...(A) + 1];
template <class... A>
constexpr char Sig<A...>::kinds[sizeof...(A) + 1];
template <class... A>
Entry entry(void (*f)(A...), const char* name) {
  return Entry{name, reinterpret_cast<void*>(f), &Sig<A...>::invoke,
               static_cast<unsigned>(sizeof...(A)), Sig<A...>::sizes, Sig<A...>::kinds};
}
}  // namespace cuda_exec
