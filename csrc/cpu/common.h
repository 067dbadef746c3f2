// Shared pieces of the CPU kernels (csrc/cpu); csrc/cuda mirrors the names.
//
// Ordering (DESIGN.md §3): larger |value| first, then smaller index.  Every
// comparison of magnitudes goes through an unsigned integer *key*: the bits of
// |x| (sign cleared), which for IEEE floats order exactly like the
// magnitudes, -0.0 == +0.0, denormals included.  NaN keys are clamped to the
// +inf key, so NaN ranks as +inf and ties with it (smaller index wins), as in
// the pure-torch reference (gtopk_plugin/kernels/reference.py).
#pragma once

// Light ATen headers only (compile time): Tensor, dispatch macros,
// at::parallel_for and the few factory functions the kernels call.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace gtopk {
namespace cpu {

// Same-size unsigned integer of a value type (float, double, Half, BFloat16).
template <typename T>
using UBits = typename std::conditional<
    sizeof(T) == 2, uint16_t,
    typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type>::type;

// Mag<scalar_t>: storage bits and magnitude key of one element.
//   bits_t  the raw storage word,
//   key_t   the magnitude key (kBits significant bits: the sign bit is 0),
//   kInf    the key of +inf (NaN keys are clamped to it).
template <typename scalar_t>
struct Mag;

template <>
struct Mag<float> {
  using bits_t = uint32_t;
  using key_t = uint32_t;
  static constexpr int kBits = 31;
  static constexpr key_t kInf = 0x7F800000u;
  static inline key_t key(bits_t b) {
    const key_t m = b & 0x7FFFFFFFu;
    return m < kInf ? m : kInf;
  }
};

template <>
struct Mag<double> {
  using bits_t = uint64_t;
  using key_t = uint64_t;
  static constexpr int kBits = 63;
  static constexpr key_t kInf = 0x7FF0000000000000ull;
  static inline key_t key(bits_t b) {
    const key_t m = b & 0x7FFFFFFFFFFFFFFFull;
    return m < kInf ? m : kInf;
  }
};

template <>
struct Mag<c10::Half> {
  using bits_t = uint16_t;
  using key_t = uint16_t;
  static constexpr int kBits = 15;
  static constexpr key_t kInf = 0x7C00u;
  static inline key_t key(bits_t b) {
    const key_t m = static_cast<key_t>(b & 0x7FFFu);
    return m < kInf ? m : kInf;
  }
};

template <>
struct Mag<c10::BFloat16> {
  using bits_t = uint16_t;
  using key_t = uint16_t;
  static constexpr int kBits = 15;
  static constexpr key_t kInf = 0x7F80u;
  static inline key_t key(bits_t b) {
    const key_t m = static_cast<key_t>(b & 0x7FFFu);
    return m < kInf ? m : kInf;
  }
};

// Scan<M>::mask16(p, L): bit j set when p[j] (j < 16) may have key >= L
// (L <= M::kInf).  Exact for 16- and 32-bit keys; for doubles a superset
// (the high words only), so callers re-check every set bit.  The SSE2 paths
// (baseline x86-64) compare the sign-cleared bits as signed integers, which
// is exact because keys stay below 2^(bits-1); a NaN's bits exceed kInf >= L,
// so the +inf clamp is not needed here.
template <typename M>
struct Scan {
  static inline uint32_t mask16(const typename M::bits_t* p, typename M::key_t L) {
    uint32_t m = 0;
    for (int j = 0; j < 16; ++j) m |= static_cast<uint32_t>(M::key(p[j]) >= L) << j;
    return m;
  }
};

#if defined(__SSE2__)
template <>
struct Scan<Mag<float>> {
  static inline uint32_t mask16(const uint32_t* p, uint32_t L) {
    const __m128i abs = _mm_set1_epi32(0x7FFFFFFF);
    const __m128i lm1 = _mm_set1_epi32(static_cast<int32_t>(L) - 1);
    const __m128i c0 = _mm_cmpgt_epi32(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), abs), lm1);
    const __m128i c1 = _mm_cmpgt_epi32(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4)), abs), lm1);
    const __m128i c2 = _mm_cmpgt_epi32(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)), abs), lm1);
    const __m128i c3 = _mm_cmpgt_epi32(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 12)), abs), lm1);
    if (!_mm_movemask_epi8(_mm_or_si128(_mm_or_si128(c0, c1), _mm_or_si128(c2, c3)))) return 0;
    return static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(c0))) |
           static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(c1))) << 4 |
           static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(c2))) << 8 |
           static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(c3))) << 12;
  }
};

template <typename M16>
struct Scan16 {
  static inline uint32_t mask16(const uint16_t* p, uint16_t L) {
    const __m128i abs = _mm_set1_epi16(0x7FFF);
    const __m128i lm1 = _mm_set1_epi16(static_cast<int16_t>(static_cast<int>(L) - 1));
    const __m128i c0 = _mm_cmpgt_epi16(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), abs), lm1);
    const __m128i c1 = _mm_cmpgt_epi16(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)), abs), lm1);
    return static_cast<uint32_t>(_mm_movemask_epi8(_mm_packs_epi16(c0, c1)));
  }
};
template <>
struct Scan<Mag<c10::Half>> : Scan16<Mag<c10::Half>> {};
template <>
struct Scan<Mag<c10::BFloat16>> : Scan16<Mag<c10::BFloat16>> {};

template <>
struct Scan<Mag<double>> {
  // High words of 4 doubles (p[0..4)) >= high word of L, as a 4-bit mask.
  static inline uint32_t quad(const uint64_t* p, __m128i abs, __m128i lm1) {
    const __m128 a = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m128 b = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2)));
    const __m128i hi = _mm_castps_si128(_mm_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    return static_cast<uint32_t>(
        _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(_mm_and_si128(hi, abs), lm1))));
  }
  static inline uint32_t mask16(const uint64_t* p, uint64_t L) {
    const __m128i abs = _mm_set1_epi32(0x7FFFFFFF);
    const __m128i lm1 = _mm_set1_epi32(static_cast<int32_t>(L >> 32) - 1);
    return quad(p, abs, lm1) | quad(p + 4, abs, lm1) << 4 | quad(p + 8, abs, lm1) << 8 |
           quad(p + 12, abs, lm1) << 12;
  }
};
#endif

// ExpBits<T>: an entry is Inf or NaN iff its exponent field is all ones, i.e.
// iff (bits & kExp) + kLsb carries into the sign bit (OR-able, vectorises).
template <typename scalar_t>
struct ExpBits;
template <>
struct ExpBits<float> {
  using bits_t = uint32_t;
  static constexpr bits_t kExp = 0x7F800000u, kLsb = 0x00800000u, kSign = 0x80000000u;
};
template <>
struct ExpBits<double> {
  using bits_t = uint64_t;
  static constexpr bits_t kExp = 0x7FF0000000000000ull, kLsb = 0x0010000000000000ull,
                          kSign = 0x8000000000000000ull;
};

// Accumulators of at least this many bytes are written with non-temporal
// stores: no cache holds them until their next use (the next step), so a
// normal store would only add a read of each line for ownership.
constexpr int64_t kStreamBytes = int64_t(4) << 20;

// out[i] = g[i] (+ r[i]) for i in [b, e); true when out[b, e) is all finite:
// the accumulator is checked, not only the gradient, so a residual or a sum
// that overflowed is caught too (docs/design.md §3: state stays finite).
template <typename scalar_t>
inline bool compensate_range(scalar_t* out, const scalar_t* g, const scalar_t* r, int64_t b, int64_t e) {
  using E = ExpBits<scalar_t>;
  using bits_t = typename E::bits_t;
  bits_t bad = 0;
  if (r != nullptr) {
    for (int64_t i = b; i < e; ++i) {
      const scalar_t v = g[i] + r[i];
      bits_t w;
      std::memcpy(&w, &v, sizeof(w));
      bad |= (w & E::kExp) + E::kLsb;
      out[i] = v;
    }
  } else {
    for (int64_t i = b; i < e; ++i) {
      bits_t w;
      std::memcpy(&w, g + i, sizeof(w));
      bad |= (w & E::kExp) + E::kLsb;
      out[i] = g[i];
    }
  }
  return (bad & E::kSign) == 0;
}

// compensate_range for a large float32 accumulator: the same sums, written
// with non-temporal stores (kStreamBytes); the caller fences (_mm_sfence)
// before the result is read.
inline bool compensate_range_stream(float* out, const float* g, const float* r, int64_t b, int64_t e) {
#if defined(__SSE2__)
  using E = ExpBits<float>;
  int64_t i = b;
  uint32_t bad = 0;
  for (; i < e && (reinterpret_cast<uintptr_t>(out + i) & 15) != 0; ++i) {
    const float v = r != nullptr ? g[i] + r[i] : g[i];
    uint32_t w;
    std::memcpy(&w, &v, sizeof(w));
    bad |= (w & E::kExp) + E::kLsb;
    out[i] = v;
  }
  const __m128i expm = _mm_set1_epi32(static_cast<int32_t>(E::kExp));
  const __m128i lsb = _mm_set1_epi32(static_cast<int32_t>(E::kLsb));
  __m128i badv = _mm_setzero_si128();
  if (r != nullptr) {
    for (; i + 4 <= e; i += 4) {
      const __m128 sv = _mm_add_ps(_mm_loadu_ps(g + i), _mm_loadu_ps(r + i));
      badv = _mm_or_si128(badv, _mm_add_epi32(_mm_and_si128(_mm_castps_si128(sv), expm), lsb));
      _mm_stream_ps(out + i, sv);
    }
  } else {
    for (; i + 4 <= e; i += 4) {
      const __m128 gv = _mm_loadu_ps(g + i);
      badv = _mm_or_si128(badv, _mm_add_epi32(_mm_and_si128(_mm_castps_si128(gv), expm), lsb));
      _mm_stream_ps(out + i, gv);
    }
  }
  alignas(16) uint32_t lanes[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), badv);
  bad |= lanes[0] | lanes[1] | lanes[2] | lanes[3];
  const bool tail_ok = compensate_range<float>(out, g, r, i, e);
  return (bad & E::kSign) == 0 && tail_ok;
#else
  return compensate_range<float>(out, g, r, b, e);
#endif
}

template <typename scalar_t>
inline typename Mag<scalar_t>::key_t key_of(const scalar_t& v) {
  typename Mag<scalar_t>::bits_t b;
  static_assert(sizeof(b) == sizeof(scalar_t), "storage size");
  std::memcpy(&b, &v, sizeof(b));
  return Mag<scalar_t>::key(b);
}

// The r-th largest (1-based, 1 <= r <= n) of the unsigned keys p[0, n):
// an MSD radix select, up to 8 bits per pass, each pass a histogram of the
// entries that share the digits found so far (the first pass reads p, the
// others a shrinking copy).  Instead of nth_element's data-dependent
// partitioning (a mispredicted branch per comparison on random keys).  p is
// left unchanged.
//
// Why it is shaped so (issue #15): the keys it gets are magnitudes that
// already passed a bound (a merge's union, a top-k's candidates), so their
// top bits mostly agree -- one OR/AND pass finds the bits where they differ
// and the passes start there instead of histogramming identical digits;
// four interleaved histograms keep runs of equal digits from serialising on
// one counter; the narrowing copy is branch-free (which entries share the
// digit is a coin toss).
template <typename K>
K kth_largest_radix(const K* p, int64_t n, int64_t r) {
  K any = 0, all = static_cast<K>(~K(0));
  for (int64_t i = 0; i < n; ++i) {
    any = static_cast<K>(any | p[i]);
    all = static_cast<K>(all & p[i]);
  }
  const uint64_t diff = static_cast<uint64_t>(any ^ all);
  if (diff == 0) return p[0];  // every key equal
  int shift = 64 - __builtin_clzll(diff);  // the keys agree on every bit from `shift` up
  const uint64_t low = shift >= 64 ? ~uint64_t(0) : (uint64_t(1) << shift) - 1;
  K prefix = static_cast<K>(static_cast<uint64_t>(all) & ~low);
  std::vector<K> cur;
  const K* src = p;
  int64_t m = n;
  while (shift > 0) {
    const int nb = std::min(8, shift), sh = shift - nb;
    const uint32_t mask = (1u << nb) - 1;
    uint32_t h[4][256];
    std::memset(h, 0, sizeof(h));
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
      ++h[0][(src[i] >> sh) & mask];
      ++h[1][(src[i + 1] >> sh) & mask];
      ++h[2][(src[i + 2] >> sh) & mask];
      ++h[3][(src[i + 3] >> sh) & mask];
    }
    for (; i < m; ++i) ++h[0][(src[i] >> sh) & mask];
    uint32_t b = mask;
    int64_t hb = 0;
    for (;; --b) {
      hb = int64_t(h[0][b]) + h[1][b] + h[2][b] + h[3][b];
      if (b == 0 || hb >= r) break;
      r -= hb;
    }
    prefix = static_cast<K>(prefix | (static_cast<K>(b) << sh));
    if (sh == 0) break;
    if (hb != m) {  // narrow to the digit's bucket (in place after the first pass)
      if (cur.empty()) cur.resize(static_cast<size_t>(m));
      K* dst = cur.data();
      int64_t w = 0;
      for (int64_t q = 0; q < m; ++q) {
        const K v = src[q];
        dst[w] = v;
        w += ((v >> sh) & mask) == b;
      }
      src = dst;
      m = w;
    }
    shift = sh;
  }
  return prefix;
}

// Runs body(tid, i) for every i in [0, n) on torch's intra-op threads,
// handing indices out one at a time in increasing order (tid in [0, threads)
// names the worker, e.g. for per-thread scratch).  Unlike the static split of
// at::parallel_for, a thread that falls behind -- descheduled on a busy
// machine, or given the heavy items -- does not hold up the others.  Inside a
// parallel region it runs serially.  Returns the number of workers used.
template <typename F>
int64_t parallel_dynamic(int64_t n, const F& body) {
  if (n <= 0) return 0;
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  if (nt <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) body(0, i);
    return 1;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) body(t0, i);
    (void)t1;
  });
  return nt;
}

// Index dtype of a buffer (DESIGN.md §3 wire format): int32 unless it has more
// elements than int32 holds.
constexpr int64_t kInt32Limit = 2147483647LL;

inline at::ScalarType index_type_for(int64_t numel) {
  return numel <= kInt32Limit ? at::kInt : at::kLong;
}

// Runs `f` with index_t = int32_t or int64_t matching `t`'s dtype.
#define GTOPK_DISPATCH_INDEX(TYPE, NAME, ...)                                   \
  [&] {                                                                         \
    if ((TYPE) == at::kInt) {                                                   \
      using index_t = int32_t;                                                  \
      return __VA_ARGS__();                                                     \
    } else if ((TYPE) == at::kLong) {                                           \
      using index_t = int64_t;                                                  \
      return __VA_ARGS__();                                                     \
    }                                                                           \
    TORCH_CHECK(false, NAME, ": indices must be int32 or int64, got ", (TYPE)); \
  }()

// The four value dtypes every kernel supports.
#define GTOPK_DISPATCH_VALUES(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

// Checks shared by the segmented kernels: x is 1-D, offsets holds S+1
// non-decreasing boundaries within x, k holds S counts.
inline void check_segments(const at::Tensor& x, const at::Tensor& offsets, const at::Tensor& k,
                           const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, ": x must be a CPU tensor");
  TORCH_CHECK(x.dim() == 1, name, ": x must be 1-D, got shape ", x.sizes());
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong && offsets.is_contiguous(),
              name, ": offsets must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(k.dim() == 1 && k.scalar_type() == at::kLong && k.is_contiguous(), name,
              ": k must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(offsets.numel() == k.numel() + 1, name, ": offsets must have len(k) + 1 = ",
              k.numel() + 1, " entries, got ", offsets.numel());
  const int64_t* o = offsets.data_ptr<int64_t>();
  const int64_t S = k.numel();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(o[s] >= 0 && o[s] <= o[s + 1] && o[s + 1] <= x.numel(), name,
                ": offsets must be non-decreasing within [0, x.numel()]");
  }
}

}  // namespace cpu
}  // namespace gtopk
