// Scatter of a sparse result into a dense buffer, fused into one pass over
// the dense buffer: a thread writes its range (zeros) and then the sparse
// entries that fall into it while the range is still in cache.  Indices are
// unique (every caller passes a selected set); ascending indices take the
// fused path, any other order a fill followed by a parallel scatter.
//
// Arithmetic matches the reference bit for bit: the division by the number of
// workers is a true division in the value type's opmath (float for fp16 and
// bf16, as torch divides by a Python scalar).
#include "common.h"
#include "ops.h"

#include <ATen/OpMathType.h>

#include <atomic>
#include <tuple>
#include <type_traits>
#include <vector>

namespace gtopk {
namespace cpu {
namespace {

constexpr int64_t kRange = 1 << 16;  // dense elements per work item

template <typename scalar_t>
inline scalar_t divide(scalar_t v, int64_t divisor) {
  using opmath_t = at::opmath_type<scalar_t>;
  return static_cast<scalar_t>(static_cast<opmath_t>(v) / static_cast<opmath_t>(divisor));
}

template <typename index_t>
bool ascending(const index_t* p, int64_t n) {
  for (int64_t i = 1; i < n; ++i)
    if (p[i] <= p[i - 1]) return false;
  return true;
}

// For ascending idx: calls body(j) for every j with idx[j] in [b, e).
template <typename index_t, typename F>
inline void for_indices_in(const index_t* idx, int64_t n, int64_t b, int64_t e, const F& body) {
  int64_t j = std::lower_bound(idx, idx + n, b, [](index_t a, int64_t v) { return a < v; }) - idx;
  for (; j < n && static_cast<int64_t>(idx[j]) < e; ++j) body(j);
}

template <typename scalar_t, typename index_t>
void scatter_into(scalar_t* out, int64_t numel, const index_t* idx, const scalar_t* v, int64_t n,
                  int64_t divisor, bool fused) {
  auto value = [&](int64_t j) { return divisor == 1 ? v[j] : divide(v[j], divisor); };
  if (fused) {
    at::parallel_for(0, numel, kRange, [&](int64_t b, int64_t e) {
      std::fill(out + b, out + e, scalar_t(0.0f));
      for_indices_in(idx, n, b, e, [&](int64_t j) { out[idx[j]] = value(j); });
    });
  } else {
    at::parallel_for(0, numel, kRange,
                     [&](int64_t b, int64_t e) { std::fill(out + b, out + e, scalar_t(0.0f)); });
    at::parallel_for(0, n, kRange, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) out[idx[j]] = value(j);
    });
  }
}

void check_sparse(const at::Tensor& idx, const at::Tensor& vals, const char* name) {
  TORCH_CHECK(idx.dim() == 1 && vals.dim() == 1 && idx.numel() == vals.numel(), name,
              ": indices and values must be 1-D of one length");
  TORCH_CHECK(idx.device().is_cpu() && vals.device().is_cpu(), name, ": CPU tensors expected");
}

template <typename index_t>
void check_range(const index_t* p, int64_t n, int64_t numel, const char* name) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok &= p[i] >= 0 && static_cast<int64_t>(p[i]) < numel;
  TORCH_CHECK(ok, name, ": index out of range [0, ", numel, ")");
}

}  // namespace

at::Tensor scatter_update(int64_t numel, const at::Tensor& idx_, const at::Tensor& vals_,
                          int64_t divisor) {
  TORCH_CHECK(numel >= 0 && divisor != 0, "scatter_update: numel >= 0 and divisor != 0");
  check_sparse(idx_, vals_, "scatter_update");
  const at::Tensor idx = idx_.contiguous(), vals = vals_.contiguous();
  at::Tensor out = at::empty({numel}, vals.options());
  GTOPK_DISPATCH_VALUES(vals.scalar_type(), "scatter_update", [&] {
    GTOPK_DISPATCH_INDEX(idx.scalar_type(), "scatter_update", [&] {
      const index_t* ip = idx.data_ptr<index_t>();
      check_range(ip, idx.numel(), numel, "scatter_update");
      scatter_into(out.data_ptr<scalar_t>(), numel, ip, vals.data_ptr<scalar_t>(), idx.numel(),
                   divisor, ascending(ip, idx.numel()));
    });
  });
  return out;
}

// The positions of the entries of x whose bits are not all zero (every
// value but +0.0: -0.0, NaN and denormals count; by the bits, so a thread
// that treats denormals as zero does not drop them), ascending, int64: the
// inverse of scatter_update, for a dense update known to be sparse (the
// hierarchical leader's result, issue #18).  One read of x; torch.nonzero
// takes two passes and an (n, 1) result.  With limit >= 0 it gives up once
// more than `limit` were found (the caller then sends the dense vector):
// (idx, true), or (an empty tensor, false).  float32 tests 16 entries per
// step (SSE2) and branches only on a group that holds one -- rare in a
// sparse vector, so well predicted.
std::tuple<at::Tensor, bool> nonzero_indices(const at::Tensor& x, int64_t limit) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 1 && x.is_contiguous(),
              "nonzero_indices: a contiguous 1-D CPU tensor expected");
  const int64_t n = x.numel(), nblk = (n + kRange - 1) / kRange;
  std::vector<std::vector<int64_t>> part(static_cast<size_t>(nblk));
  std::atomic<int64_t> found{0};
  std::atomic<bool> over{false};
  GTOPK_DISPATCH_VALUES(x.scalar_type(), "nonzero_indices", [&] {
    using U = UBits<scalar_t>;
    const U* p = reinterpret_cast<const U*>(x.data_ptr<scalar_t>());
    at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1 && !over.load(std::memory_order_relaxed); ++blk) {
        std::vector<int64_t>& out = part[static_cast<size_t>(blk)];
        int64_t i = blk * kRange;
        const int64_t e = std::min(n, i + kRange);
#if defined(__SSE2__)
        if (std::is_same<scalar_t, float>::value) {
          const __m128i zero = _mm_setzero_si128();
          for (; i + 16 <= e; i += 16) {
            uint32_t mk = 0;
            for (int q = 0; q < 4; ++q) {
              const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i + 4 * q));
              const __m128i z = _mm_cmpeq_epi32(w, zero);  // +0.0 lanes
              mk |= static_cast<uint32_t>(~_mm_movemask_ps(_mm_castsi128_ps(z)) & 0xF) << (4 * q);
            }
            while (mk) {
              out.push_back(i + __builtin_ctz(mk));
              mk &= mk - 1;
            }
          }
        }
#endif
        for (; i < e; ++i)
          if (p[i] != 0) out.push_back(i);
        const int64_t got = static_cast<int64_t>(out.size());
        if (limit >= 0 && found.fetch_add(got, std::memory_order_relaxed) + got > limit)
          over.store(true, std::memory_order_relaxed);
      }
    });
  });
  if (over.load()) return {at::empty({0}, x.options().dtype(at::kLong)), false};
  int64_t total = 0;
  for (const auto& v : part) total += static_cast<int64_t>(v.size());
  at::Tensor idx = at::empty({total}, x.options().dtype(at::kLong));
  int64_t* o = idx.data_ptr<int64_t>();
  for (const auto& v : part) o = std::copy(v.begin(), v.end(), o);
  return {idx, true};
}

}  // namespace cpu
}  // namespace gtopk
