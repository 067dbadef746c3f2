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

// float32, SSE2: the flags on the raw bits (E = the biased exponent field),
// one multiplication, streamed stores for large buffers (the caller fences).
Flags prescale_range_f32(float* out, const float* g, int64_t b, int64_t e, int shift, bool stream) {
#if defined(__SSE2__)
  int64_t i = b;
  while (i < e && (reinterpret_cast<uintptr_t>(out + i) & 15) != 0) ++i;
  const Flags head = prescale_range<float>(out, g, b, i, shift);
  const __m128i expm = _mm_set1_epi32(0x7F800000), lsb = _mm_set1_epi32(0x00800000);
  const __m128i absm = _mm_set1_epi32(0x7FFFFFFF), zi = _mm_setzero_si128();
  // exact: |g| == 0, or E >= 24 + shift and E < 254 - shift (as ex = E << 23)
  const __m128i lo_ex = _mm_set1_epi32((24 + shift) << 23), hi_ex = _mm_set1_epi32(((254 - shift) << 23) - 1);
  const __m128 sv = _mm_set1_ps(std::ldexp(1.0f, -shift)), zf = _mm_setzero_ps();
  __m128i nonfin = zi, inexact = zi, cnt = zi;
  for (; i + 4 <= e; i += 4) {
    const __m128 xv = _mm_loadu_ps(g + i);
    const __m128i w = _mm_castps_si128(xv);
    const __m128i ex = _mm_and_si128(w, expm);
    nonfin = _mm_or_si128(nonfin, _mm_add_epi32(ex, lsb));  // carries into the sign bit iff E = 255
    const __m128i nz = _mm_xor_si128(_mm_cmpeq_epi32(_mm_and_si128(w, absm), zi), _mm_set1_epi32(-1));
    inexact = _mm_or_si128(inexact, _mm_and_si128(nz, _mm_or_si128(_mm_cmplt_epi32(ex, lo_ex),
                                                                    _mm_cmpgt_epi32(ex, hi_ex))));
    // shift 0: the bits as they are (a multiplication by 1.0 would flush
    // denormals under FTZ and quieten a signalling NaN)
    const __m128 v = shift == 0 ? xv : _mm_mul_ps(xv, sv);
    if (stream) {
      _mm_stream_ps(out + i, v);
    } else {
      _mm_store_ps(out + i, v);
    }
    cnt = _mm_sub_epi32(cnt, _mm_castps_si128(_mm_cmpneq_ps(v, zf)));  // -1 per nonzero
  }
  alignas(16) int32_t c[4], nf[4], ix[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(c), cnt);
  _mm_store_si128(reinterpret_cast<__m128i*>(nf), nonfin);
  _mm_store_si128(reinterpret_cast<__m128i*>(ix), inexact);
  const Flags tail = prescale_range<float>(out, g, i, e, shift);
  Flags f;
  f.nnz = head.nnz + tail.nnz + int64_t(c[0]) + c[1] + c[2] + c[3];
  f.finite = head.finite && tail.finite && ((nf[0] | nf[1] | nf[2] | nf[3]) & int32_t(0x80000000)) == 0;
  f.exact = head.exact && tail.exact && (shift == 0 || (ix[0] | ix[1] | ix[2] | ix[3]) == 0);
  return f;
#else
  (void)stream;
  return prescale_range<float>(out, g, b, e, shift);
#endif
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
