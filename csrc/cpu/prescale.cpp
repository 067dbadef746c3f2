// The dense step's one pass (issue #15): the gradient copied into the buffer
// the allreduce sums in place -- the update buffer itself -- already divided
// by the world size P = 2^shift, with the finiteness check and the count of
// nonzero entries in the same read:
//
//   out = grad * 2^-shift;  returns (all finite, exact, nonzeros of out)
//
// A sum of values prescaled by a power of two equals the sum divided
// afterwards, bit for bit, when every value is a multiple of the smallest
// normal times 2^shift and no partial sum can overflow: then every partial
// sum, unscaled or scaled, in any order and grouping the engine adds, is
// zero or normal (never denormal, so flushing denormals changes nothing),
// each addition commutes with the scaling, and the final division is exact.
// `exact` says whether that holds for this rank's entries: each is zero, or
// its magnitude lies in [tiny * 2^(shift + p - 1), 2^(emax - shift)), p the
// significand's bits (float32: [2^(shift - 103), 2^(127 - shift)): its
// last bit is then worth at least 2^(shift - 126)).  NaN and Inf are not
// exact (a non-finite step is skipped or raises anyway).  When any rank's
// entries are not, every rank redoes the copy unscaled and divides after
// the sum (gtopk_plugin/dense_direct.py); the consistency check carries the
// flag.  Reference: gtopk_plugin/kernels/reference.py (prescale_copy), bit
// for bit.
#include "common.h"
#include "ops.h"

#include <ATen/OpMathType.h>

#include <cmath>

namespace gtopk {
namespace cpu {
namespace {

constexpr int64_t kGrain = 1 << 16;

// zero by its bits (sign cleared): a denormal is not zero even where the
// calling thread treats denormals as zero (DAZ) -- the engine that sums may not
template <typename T>
inline bool zero_bits(const T& x) {
  if constexpr (sizeof(T) == 2) {
    uint16_t w;
    std::memcpy(&w, &x, 2);
    return (w & 0x7FFFu) == 0;
  } else if constexpr (sizeof(T) == 4) {
    uint32_t w;
    std::memcpy(&w, &x, 4);
    return (w & 0x7FFFFFFFu) == 0;
  } else {
    uint64_t w;
    std::memcpy(&w, &x, 8);
    return (w & 0x7FFFFFFFFFFFFFFFull) == 0;
  }
}

struct Flags {
  bool finite = true, exact = true;
  int64_t nnz = 0;
};

// Any floating type, one entry at a time, in the value type's opmath.
template <typename scalar_t>
Flags prescale_range(scalar_t* out, const scalar_t* g, int64_t b, int64_t e, int shift) {
  using opmath_t = at::opmath_type<scalar_t>;
  using lim = std::numeric_limits<scalar_t>;
  const opmath_t s = std::ldexp(opmath_t(1), -shift);
  const opmath_t lo = std::ldexp(static_cast<opmath_t>(lim::min()), shift + lim::digits - 1);
  const opmath_t hi = std::ldexp(opmath_t(1), lim::max_exponent - 1 - shift);
  Flags f;
  for (int64_t i = b; i < e; ++i) {
    const opmath_t v = static_cast<opmath_t>(g[i]);
    const opmath_t a = std::abs(v);
    f.finite &= std::isfinite(v);
    f.exact &= shift == 0 || zero_bits(g[i]) || (a >= lo && a < hi);
    const scalar_t o = shift == 0 ? g[i] : static_cast<scalar_t>(v * s);
    out[i] = o;
    f.nnz += static_cast<opmath_t>(o) != opmath_t(0);
  }
  return f;
}

// float32 vector loops.  The flags on the raw bits: t = |g|'s bits orders
// like |g|, so "exact" is t == 0 or LO <= t <= HI1 (LO = (24 + shift) << 23,
// HI1 = ((254 - shift) << 23) - 1, the exponent field's bounds) and
// "finite" is t <= 0x7F7FFFFF; signed compares are safe (t < 2^31).
// kScale false (shift 0): a bit copy (a multiplication by 1.0 would flush
// denormals under FTZ and quieten a signalling NaN) and no range test.
// Counted nonzeros: compare-not-equal with zero, NaN counting, as torch.
// Streamed stores for large buffers (the caller fences).  AVX2 where the
// CPU has it (chosen at run time: the extension is built for baseline
// x86-64), else SSE2, else the scalar loop.
#if defined(__SSE2__)
template <bool kScale>
void prescale_sse2(float* out, const float* g, int64_t& i, int64_t e, int shift, bool stream,
                   int32_t lanes[3][8]) {
  const __m128i absm = _mm_set1_epi32(0x7FFFFFFF), fmax = _mm_set1_epi32(0x7F7FFFFF);
  const __m128i lo = _mm_set1_epi32((24 + shift) << 23), hi1 = _mm_set1_epi32(((254 - shift) << 23) - 1);
  const __m128i zi = _mm_setzero_si128();
  const __m128 sv = _mm_set1_ps(std::ldexp(1.0f, -shift)), zf = _mm_setzero_ps();
  __m128i nonfin = zi, inexact = zi, cnt = zi;
  for (; i + 4 <= e; i += 4) {
    const __m128 xv = _mm_loadu_ps(g + i);
    const __m128i t = _mm_and_si128(_mm_castps_si128(xv), absm);
    nonfin = _mm_or_si128(nonfin, _mm_cmpgt_epi32(t, fmax));
    if (kScale) {
      const __m128i low = _mm_andnot_si128(_mm_cmpeq_epi32(t, zi), _mm_cmplt_epi32(t, lo));
      inexact = _mm_or_si128(inexact, _mm_or_si128(low, _mm_cmpgt_epi32(t, hi1)));
    }
    const __m128 v = kScale ? _mm_mul_ps(xv, sv) : xv;
    if (stream) {
      _mm_stream_ps(out + i, v);
    } else {
      _mm_store_ps(out + i, v);
    }
    cnt = _mm_sub_epi32(cnt, _mm_castps_si128(_mm_cmpneq_ps(v, zf)));  // -1 per nonzero
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lanes[0]), cnt);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lanes[1]), nonfin);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lanes[2]), inexact);
}
#endif

#if defined(__GNUC__) && defined(__x86_64__)
#define GTOPK_HAVE_AVX2_PATH 1
#include <immintrin.h>
template <bool kScale>
__attribute__((target("avx2"))) void prescale_avx2(float* out, const float* g, int64_t& i, int64_t e,
                                                   int shift, bool stream, int32_t lanes[3][8]) {
  const __m256i absm = _mm256_set1_epi32(0x7FFFFFFF), fmax = _mm256_set1_epi32(0x7F7FFFFF);
  const __m256i lo = _mm256_set1_epi32((24 + shift) << 23), hi1 = _mm256_set1_epi32(((254 - shift) << 23) - 1);
  const __m256i zi = _mm256_setzero_si256();
  const __m256 sv = _mm256_set1_ps(std::ldexp(1.0f, -shift)), zf = _mm256_setzero_ps();
  __m256i nonfin = zi, inexact = zi, cnt = zi;
  for (; i + 8 <= e; i += 8) {
    const __m256 xv = _mm256_loadu_ps(g + i);
    const __m256i t = _mm256_and_si256(_mm256_castps_si256(xv), absm);
    nonfin = _mm256_or_si256(nonfin, _mm256_cmpgt_epi32(t, fmax));
    if (kScale) {
      const __m256i low = _mm256_andnot_si256(_mm256_cmpeq_epi32(t, zi), _mm256_cmpgt_epi32(lo, t));
      inexact = _mm256_or_si256(inexact, _mm256_or_si256(low, _mm256_cmpgt_epi32(t, hi1)));
    }
    const __m256 v = kScale ? _mm256_mul_ps(xv, sv) : xv;
    if (stream) {
      _mm256_stream_ps(out + i, v);
    } else {
      _mm256_store_ps(out + i, v);
    }
    cnt = _mm256_sub_epi32(cnt, _mm256_castps_si256(_mm256_cmp_ps(v, zf, _CMP_NEQ_UQ)));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes[0]), cnt);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes[1]), nonfin);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes[2]), inexact);
}

bool cpu_has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

Flags prescale_range_f32(float* out, const float* g, int64_t b, int64_t e, int shift, bool stream) {
  int64_t i = b;
  while (i < e && (reinterpret_cast<uintptr_t>(out + i) & 31) != 0) ++i;
  const Flags head = prescale_range<float>(out, g, b, i, shift);
  int32_t lanes[3][8] = {};
#if defined(GTOPK_HAVE_AVX2_PATH)
  if (cpu_has_avx2()) {
    shift ? prescale_avx2<true>(out, g, i, e, shift, stream, lanes)
          : prescale_avx2<false>(out, g, i, e, shift, stream, lanes);
  }
#endif
#if defined(__SSE2__)
  // the rest (all of it without AVX2) four at a time; `lanes` holds the
  // AVX2 loop's sums in its 8 lanes, so SSE2's go into a second set
  int32_t more[3][8] = {};
  shift ? prescale_sse2<true>(out, g, i, e, shift, stream, more)
        : prescale_sse2<false>(out, g, i, e, shift, stream, more);
  for (int r = 0; r < 3; ++r)
    for (int l = 0; l < 8; ++l) lanes[r][l] = r == 0 ? lanes[r][l] + more[r][l] : (lanes[r][l] | more[r][l]);
#else
  (void)stream;
#endif
  const Flags tail = prescale_range<float>(out, g, i, e, shift);
  Flags f;
  f.nnz = head.nnz + tail.nnz;
  int32_t nonfin = 0, inexact = 0;
  for (int l = 0; l < 8; ++l) {
    f.nnz += lanes[0][l];
    nonfin |= lanes[1][l];
    inexact |= lanes[2][l];
  }
  f.finite = head.finite && tail.finite && nonfin == 0;
  f.exact = head.exact && tail.exact && (shift == 0 || inexact == 0);
  return f;
}

}  // namespace

std::tuple<bool, bool, int64_t> prescale_copy(const at::Tensor& out, const at::Tensor& grad, int64_t shift) {
  TORCH_CHECK(out.device().is_cpu() && grad.device().is_cpu(), "prescale_copy: CPU tensors only");
  TORCH_CHECK(out.dim() == 1 && grad.dim() == 1 && out.numel() == grad.numel() && out.is_contiguous() &&
                  grad.is_contiguous() && out.scalar_type() == grad.scalar_type(),
              "prescale_copy: out and grad must be contiguous 1-D tensors of one length and dtype");
  TORCH_CHECK(shift >= 0 && shift <= 30, "prescale_copy: shift must be in [0, 30] (P = 2^shift)");
  const char* ob = static_cast<const char*>(out.data_ptr());
  const char* gb = static_cast<const char*>(grad.data_ptr());
  const int64_t nb = grad.numel() * grad.element_size();
  TORCH_CHECK(ob == gb || ob + nb <= gb || gb + nb <= ob, "prescale_copy: out partly overlaps grad");
  const bool stream = ob != gb && nb >= kStreamBytes;
  std::atomic<bool> finite{true}, exact{true};
  std::atomic<int64_t> nnz{0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "prescale_copy", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* g = grad.data_ptr<scalar_t>();
    at::parallel_for(0, grad.numel(), kGrain, [&](int64_t b, int64_t e) {
      Flags f;
      if (std::is_same<scalar_t, float>::value) {
        f = prescale_range_f32(reinterpret_cast<float*>(o), reinterpret_cast<const float*>(g), b, e,
                               static_cast<int>(shift), stream);
#if defined(__SSE2__)
        if (stream) _mm_sfence();  // this thread's streamed stores, before the sum reads them
#endif
      } else {
        f = prescale_range<scalar_t>(o, g, b, e, static_cast<int>(shift));
      }
      if (!f.finite) finite.store(false, std::memory_order_relaxed);
      if (!f.exact) exact.store(false, std::memory_order_relaxed);
      nnz.fetch_add(f.nnz, std::memory_order_relaxed);
    });
  });
  return std::make_tuple(finite.load(), exact.load(), nnz.load());
}

}  // namespace cpu
}  // namespace gtopk
