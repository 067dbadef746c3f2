// Error-feedback compensation fused with the finiteness check (DESIGN.md §3;
// gTop-k paper, Algorithm 2, line "acc = grad + residual"):
//
//   out = grad + residual   (out = grad when there is no residual)
//   returns whether every entry of out is finite (a non-finite gradient
//   or residual, or a sum that overflowed: the accumulator is what state
//   is made of, so it is what the check covers; docs/design.md §3)
//
// in one streaming pass: the check costs no extra read of the gradient (the
// reducer used to read it once for the check and once more to compensate).
// `out` is a buffer of the caller's (the reducer's scratch accumulator), so a
// non-finite step leaves every piece of state untouched.  One IEEE addition
// per element in the value type, as torch.add(grad, residual): bit for bit
// the reference (gtopk_plugin/kernels/reference.py: compensate).
//
// The finiteness test works on the raw bits: an entry is Inf or NaN iff its
// exponent field is all ones, i.e. iff (bits & EXP) + EXP_LSB carries into the
// sign bit; OR-ing those words over a range vectorises on baseline x86-64.
#include "common.h"
#include "ops.h"

#include <ATen/OpMathType.h>

#include <type_traits>

namespace gtopk {
namespace cpu {
namespace {

constexpr int64_t kGrain = 1 << 16;
constexpr int64_t kAhead = 32;  // prefetch distance of the O(k) scatters

inline void prefetch_rw(const void* q) {
#if defined(__GNUC__)
  __builtin_prefetch(q, 1, 0);
#endif
}

// an index clamped into [0, numel) (prefetching a bad one must not fault;
// the loop itself rejects it)
template <typename I>
inline int64_t clamp_index(I v, int64_t numel) {
  const int64_t q = static_cast<int64_t>(v);
  return q < 0 ? 0 : (q >= numel ? numel - 1 : q);
}

}  // namespace

bool compensate(const at::Tensor& out, const at::Tensor& grad,
                const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(out.device().is_cpu() && grad.device().is_cpu(), "compensate: CPU tensors only");
  TORCH_CHECK(out.dim() == 1 && grad.dim() == 1 && out.numel() == grad.numel(),
              "compensate: out and grad must be 1-D of the same length");
  TORCH_CHECK(out.is_contiguous() && grad.is_contiguous(), "compensate: contiguous tensors only");
  TORCH_CHECK(out.scalar_type() == grad.scalar_type(), "compensate: out and grad dtypes differ");
  const bool has_r = residual.has_value() && residual->defined();
  if (has_r) {
    TORCH_CHECK(residual->device().is_cpu() && residual->dim() == 1 &&
                    residual->numel() == grad.numel() && residual->is_contiguous() &&
                    residual->scalar_type() == grad.scalar_type(),
                "compensate: residual must be a contiguous 1-D CPU tensor like grad");
  }
  const int64_t n = grad.numel();
  std::atomic<bool> finite{true};
  AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "compensate", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* g = grad.data_ptr<scalar_t>();
    const scalar_t* r = has_r ? residual->data_ptr<scalar_t>() : nullptr;
    const bool stream = std::is_same<scalar_t, float>::value && n * int64_t(sizeof(scalar_t)) >= kStreamBytes;
    at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
      bool ok;
      if (stream) {  // a large float32 buffer: non-temporal stores (common.h)
        ok = compensate_range_stream(reinterpret_cast<float*>(o), reinterpret_cast<const float*>(g),
                                     reinterpret_cast<const float*>(r), b, e);
#if defined(__SSE2__)
        _mm_sfence();  // visible before the result is read (another thread may)
#endif
      } else {
        ok = compensate_range<scalar_t>(o, g, r, b, e);
      }
      if (!ok) finite.store(false, std::memory_order_relaxed);
    });
  });
  return finite.load();
}

// acc[idx[j]] -= sent[j]: the error-feedback remainder made in place in the
// accumulator, O(k) (reference: ErrorFeedback.remainder_ / subtract_at_).
// Indices are unique (a selected set).  One subtraction in the value type.
// With a mask, only where it is true: the entries of this worker's
// contribution that reached the result (no gather of them first).
void subtract_at_(const at::Tensor& acc, const at::Tensor& idx, const at::Tensor& sent,
                  const c10::optional<at::Tensor>& mask) {
  TORCH_CHECK(acc.device().is_cpu() && acc.dim() == 1 && acc.is_contiguous(),
              "subtract_at_: acc must be a contiguous 1-D CPU tensor");
  TORCH_CHECK(idx.dim() == 1 && sent.dim() == 1 && idx.numel() == sent.numel() &&
                  sent.scalar_type() == acc.scalar_type(),
              "subtract_at_: idx and sent must be 1-D of one length, sent in acc's dtype");
  const bool has_m = mask.has_value() && mask->defined();
  TORCH_CHECK(!has_m || (mask->scalar_type() == at::kBool && mask->dim() == 1 &&
                         mask->numel() == idx.numel()),
              "subtract_at_: mask must be a 1-D bool tensor like idx");
  const at::Tensor i = idx.contiguous(), v = sent.contiguous();
  const at::Tensor mc = has_m ? mask->contiguous() : at::Tensor();
  const bool* m = has_m ? mc.data_ptr<bool>() : nullptr;
  const int64_t n = i.numel(), numel = acc.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, acc.scalar_type(), "subtract_at_", [&] {
    scalar_t* a = acc.data_ptr<scalar_t>();
    const scalar_t* s = v.data_ptr<scalar_t>();
    GTOPK_DISPATCH_INDEX(i.scalar_type(), "subtract_at_", [&] {
      const index_t* p = i.data_ptr<index_t>();
      for (int64_t j = 0; j < n; ++j) {
        // k scattered entries of an N-sized buffer: latency-bound, so the
        // lines kAhead entries on are requested early (misses overlap)
        if (j + kAhead < n) prefetch_rw(a + clamp_index(p[j + kAhead], numel));
        const int64_t q = static_cast<int64_t>(p[j]);
        TORCH_CHECK(q >= 0 && q < numel, "subtract_at_: index ", q, " out of range");
        if (m != nullptr && !m[j]) continue;
        a[q] = static_cast<scalar_t>(a[q] - s[j]);
      }
    });
  });
}

// The persistent update buffer of a sparse step: zero the entries the
// previous sparse result wrote (prev), then out[idx[j]] = vals[j] / divisor
// (a true division in the value type's opmath, as reference.scatter_update);
// O(k) instead of a fresh N-sized buffer of zeros.
void scatter_reset_(const at::Tensor& out, const at::Tensor& prev, const at::Tensor& idx,
                    const at::Tensor& vals, int64_t divisor) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 1 && out.is_contiguous(),
              "scatter_reset_: out must be a contiguous 1-D CPU tensor");
  TORCH_CHECK(idx.dim() == 1 && vals.dim() == 1 && idx.numel() == vals.numel() &&
                  vals.scalar_type() == out.scalar_type() && prev.dim() == 1,
              "scatter_reset_: idx/vals 1-D of one length, vals in out's dtype; prev 1-D");
  TORCH_CHECK(divisor >= 1, "scatter_reset_: divisor must be >= 1");
  const at::Tensor pv = prev.contiguous(), i = idx.contiguous(), v = vals.contiguous();
  const int64_t numel = out.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "scatter_reset_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* x = v.data_ptr<scalar_t>();
    GTOPK_DISPATCH_INDEX(pv.scalar_type(), "scatter_reset_", [&] {
      const index_t* p = pv.data_ptr<index_t>();
      for (int64_t j = 0, n = pv.numel(); j < n; ++j) {
        if (j + kAhead < n) prefetch_rw(o + clamp_index(p[j + kAhead], numel));
        const int64_t q = static_cast<int64_t>(p[j]);
        TORCH_CHECK(q >= 0 && q < numel, "scatter_reset_: index ", q, " out of range");
        o[q] = scalar_t(0.0f);
      }
    });
    GTOPK_DISPATCH_INDEX(i.scalar_type(), "scatter_reset_", [&] {
      const index_t* p = i.data_ptr<index_t>();
      for (int64_t j = 0, n = i.numel(); j < n; ++j) {
        if (j + kAhead < n) prefetch_rw(o + clamp_index(p[j + kAhead], numel));
        const int64_t q = static_cast<int64_t>(p[j]);
        TORCH_CHECK(q >= 0 && q < numel, "scatter_reset_: index ", q, " out of range");
        o[q] = divisor == 1 ? x[j]
                            : static_cast<scalar_t>(static_cast<opmath_t>(x[j]) /
                                                    static_cast<opmath_t>(divisor));
      }
    });
  });
}

// A dense result divided by the number of workers (a true division in the
// value type's opmath, as torch's x.div(divisor) and reference.div_count_)
// and its number of nonzero entries, in one pass (the reducer's stats count
// them; torch.count_nonzero materialises a bool tensor and costs three
// reads).  In place (out is x), or from x into out: the reducer sums a dense
// step in its scratch accumulator and divides it straight into the update
// (issue #15: one pass fewer than a copy, a sum in place and a division).
namespace {

// div_count of float32 x[b, e) into y[b, e) (y may be x): SSE2, one read and
// one write per element; out of place and large (kStreamBytes) the stores
// are non-temporal -- the update is read next by the optimizer, not by this
// core's cache -- and the caller fences.  The true division, as scalar code
// does it (divps rounds like the scalar division); for a power-of-two
// divisor the multiplication by its reciprocal, which is exact and so bit
// for bit the same quotient.  Returns the number of nonzero quotients (NaN
// counts, -0.0 does not).
int64_t div_count_f32(const float* x, float* y, int64_t b, int64_t e, int64_t divisor, bool stream) {
  const bool pow2 = (divisor & (divisor - 1)) == 0;
  const float d = static_cast<float>(divisor);
  int64_t c = 0, i = b;
  auto one = [&](int64_t j) {
    const float v = divisor == 1 ? x[j] : (pow2 ? x[j] * (1.0f / d) : x[j] / d);
    y[j] = v;
    c += v != 0.0f;
  };
#if defined(__SSE2__)
  for (; i < e && (reinterpret_cast<uintptr_t>(y + i) & 15) != 0; ++i) one(i);
  const __m128 dv = _mm_set1_ps(d), rv = _mm_set1_ps(pow2 ? 1.0f / d : 1.0f), zero = _mm_setzero_ps();
  __m128i cnt = _mm_setzero_si128();  // per-lane counts, at most (e - b) / 4 < 2^31 each
  for (; i + 4 <= e; i += 4) {
    const __m128 xv = _mm_loadu_ps(x + i);
    // divisor 1: the bits as they are (a multiplication by 1.0 would flush
    // denormals under FTZ and quieten a signalling NaN)
    const __m128 v = divisor == 1 ? xv : (pow2 ? _mm_mul_ps(xv, rv) : _mm_div_ps(xv, dv));
    if (stream) {
      _mm_stream_ps(y + i, v);
    } else {
      _mm_store_ps(y + i, v);
    }
    cnt = _mm_sub_epi32(cnt, _mm_castps_si128(_mm_cmpneq_ps(v, zero)));  // -1 per nonzero
  }
  alignas(16) int32_t lanes[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), cnt);
  c += int64_t(lanes[0]) + lanes[1] + lanes[2] + lanes[3];
#endif
  for (; i < e; ++i) one(i);
  return c;
}

// The nonzero entries of float32 x[b, e), read only: div_count_ in place
// by 1 (a prescaled dense sum, or op="sum", is already the update).
int64_t count_nonzero_f32(const float* x, int64_t b, int64_t e) {
  int64_t c = 0, i = b;
#if defined(__SSE2__)
  const __m128 zero = _mm_setzero_ps();
  __m128i cnt = _mm_setzero_si128();
  for (; i + 4 <= e; i += 4) cnt = _mm_sub_epi32(cnt, _mm_castps_si128(_mm_cmpneq_ps(_mm_loadu_ps(x + i), zero)));
  alignas(16) int32_t lanes[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), cnt);
  c = int64_t(lanes[0]) + lanes[1] + lanes[2] + lanes[3];
#endif
  for (; i < e; ++i) c += x[i] != 0.0f;
  return c;
}

int64_t div_count_impl(const at::Tensor& x, const at::Tensor& out, int64_t divisor) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 1 && x.is_contiguous(),
              "div_count_: x must be a contiguous 1-D CPU tensor");
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 1 && out.is_contiguous() &&
                  out.numel() == x.numel() && out.scalar_type() == x.scalar_type(),
              "div_count_: out must be a contiguous 1-D CPU tensor like x");
  TORCH_CHECK(divisor >= 1, "div_count_: divisor must be >= 1");
  const bool same = out.data_ptr() == x.data_ptr();
  const char* xb = static_cast<const char*>(x.data_ptr());
  const char* ob = static_cast<const char*>(out.data_ptr());
  const int64_t nb = x.numel() * x.element_size();
  TORCH_CHECK(same || ob + nb <= xb || xb + nb <= ob, "div_count_: out partly overlaps x");
  const bool stream = !same && x.numel() * x.element_size() >= kStreamBytes;
  std::atomic<int64_t> total{0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "div_count_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* p = x.data_ptr<scalar_t>();
    scalar_t* q = out.data_ptr<scalar_t>();
    const opmath_t d = static_cast<opmath_t>(divisor);
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t b, int64_t e) {
      int64_t c = 0;
      if (std::is_same<scalar_t, float>::value && (divisor != 1 || !same)) {
        c = div_count_f32(reinterpret_cast<const float*>(p), reinterpret_cast<float*>(q), b, e,
                          divisor, stream);
#if defined(__SSE2__)
        if (stream) _mm_sfence();  // this thread's non-temporal stores, before the result is read
#endif
      } else if (std::is_same<scalar_t, float>::value) {  // in place by 1: count only
        c = count_nonzero_f32(reinterpret_cast<const float*>(p), b, e);
      } else if (divisor == 1) {
        for (int64_t i = b; i < e; ++i) {
          if (!same) q[i] = p[i];
          c += static_cast<opmath_t>(p[i]) != opmath_t(0);
        }
      } else {
        for (int64_t i = b; i < e; ++i) {
          const scalar_t v = static_cast<scalar_t>(static_cast<opmath_t>(p[i]) / d);
          q[i] = v;
          c += static_cast<opmath_t>(v) != opmath_t(0);
        }
      }
      total.fetch_add(c, std::memory_order_relaxed);
    });
  });
  return total.load();
}

}  // namespace

int64_t div_count_(const at::Tensor& x, int64_t divisor) { return div_count_impl(x, x, divisor); }

int64_t div_count_into(const at::Tensor& x, int64_t divisor, const at::Tensor& out) {
  return div_count_impl(x, out, divisor);
}

}  // namespace cpu
}  // namespace gtopk
