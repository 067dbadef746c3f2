// Scatter of a sparse result into a dense buffer, and the error-feedback
// residual update, each fused into one pass over the dense buffer: a thread
// writes its range (zeros, or a copy of acc) and then the sparse entries that
// fall into it while the range is still in cache.  Indices are unique (every
// caller passes a selected set); ascending indices take the fused path, any
// other order a fill followed by a parallel scatter.
//
// Arithmetic matches the reference bit for bit: the division by the number of
// workers is a true division in the value type's opmath (float for fp16 and
// bf16, as torch divides by a Python scalar); acc - sent is one subtraction
// rounded to the value type.
#include "common.h"
#include "ops.h"

#include <ATen/OpMathType.h>

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

template <typename scalar_t, typename index_t>
void residual_into(scalar_t* res, const scalar_t* acc, int64_t numel, const index_t* idx,
                   const scalar_t* sent, int64_t n, bool fused) {
  auto value = [&](int64_t j) { return static_cast<scalar_t>(acc[idx[j]] - sent[j]); };
  if (fused) {
    at::parallel_for(0, numel, kRange, [&](int64_t b, int64_t e) {
      std::copy(acc + b, acc + e, res + b);
      for_indices_in(idx, n, b, e, [&](int64_t j) { res[idx[j]] = value(j); });
    });
  } else {
    at::parallel_for(0, numel, kRange,
                     [&](int64_t b, int64_t e) { std::copy(acc + b, acc + e, res + b); });
    at::parallel_for(0, n, kRange, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) res[idx[j]] = value(j);
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

at::Tensor residual_update(const at::Tensor& acc_, const at::Tensor& idx_,
                           const at::Tensor& sent_) {
  TORCH_CHECK(acc_.dim() == 1, "residual_update: acc must be 1-D");
  TORCH_CHECK(sent_.scalar_type() == acc_.scalar_type(), "residual_update: sent must have acc's dtype");
  check_sparse(idx_, sent_, "residual_update");
  const at::Tensor acc = acc_.contiguous(), idx = idx_.contiguous(), sent = sent_.contiguous();
  at::Tensor res = at::empty_like(acc);
  GTOPK_DISPATCH_VALUES(acc.scalar_type(), "residual_update", [&] {
    GTOPK_DISPATCH_INDEX(idx.scalar_type(), "residual_update", [&] {
      const index_t* ip = idx.data_ptr<index_t>();
      check_range(ip, idx.numel(), acc.numel(), "residual_update");
      residual_into(res.data_ptr<scalar_t>(), acc.data_ptr<scalar_t>(), acc.numel(), ip,
                    sent.data_ptr<scalar_t>(), idx.numel(), ascending(ip, idx.numel()));
    });
  });
  return res;
}

std::tuple<at::Tensor, at::Tensor> scatter_residual_update(const at::Tensor& acc_,
                                                           const at::Tensor& sent_idx_,
                                                           const at::Tensor& sent_,
                                                           const at::Tensor& idx_,
                                                           const at::Tensor& vals_,
                                                           int64_t divisor) {
  TORCH_CHECK(acc_.dim() == 1 && divisor != 0, "scatter_residual_update: 1-D acc, divisor != 0");
  TORCH_CHECK(sent_.scalar_type() == acc_.scalar_type() && vals_.scalar_type() == acc_.scalar_type(),
              "scatter_residual_update: sent and vals must have acc's dtype");
  TORCH_CHECK(sent_idx_.scalar_type() == idx_.scalar_type(),
              "scatter_residual_update: both index tensors must have one dtype");
  const int64_t numel = acc_.numel();
  check_sparse(sent_idx_, sent_, "scatter_residual_update");
  check_sparse(idx_, vals_, "scatter_residual_update");
  const at::Tensor acc = acc_.contiguous(), sidx = sent_idx_.contiguous(), sent = sent_.contiguous();
  const at::Tensor idx = idx_.contiguous(), vals = vals_.contiguous();
  at::Tensor update = at::empty_like(acc), res = at::empty_like(acc);
  GTOPK_DISPATCH_VALUES(acc.scalar_type(), "scatter_residual_update", [&] {
    GTOPK_DISPATCH_INDEX(idx.scalar_type(), "scatter_residual_update", [&] {
      const index_t* ip = idx.data_ptr<index_t>();
      const index_t* sp = sidx.data_ptr<index_t>();
      const int64_t n = idx.numel(), ns = sidx.numel();
      check_range(ip, n, numel, "scatter_residual_update");
      check_range(sp, ns, numel, "scatter_residual_update");
      scalar_t* up = update.data_ptr<scalar_t>();
      scalar_t* rp = res.data_ptr<scalar_t>();
      const scalar_t* ap = acc.data_ptr<scalar_t>();
      const scalar_t* vp = vals.data_ptr<scalar_t>();
      const scalar_t* sv = sent.data_ptr<scalar_t>();
      if (ascending(ip, n) && ascending(sp, ns)) {
        // One pass: both outputs of a range are written, then patched in cache.
        at::parallel_for(0, numel, kRange, [&](int64_t b, int64_t e) {
          std::fill(up + b, up + e, scalar_t(0.0f));
          std::copy(ap + b, ap + e, rp + b);
          for_indices_in(ip, n, b, e, [&](int64_t j) {
            up[ip[j]] = divisor == 1 ? vp[j] : divide(vp[j], divisor);
          });
          for_indices_in(sp, ns, b, e, [&](int64_t j) {
            rp[sp[j]] = static_cast<scalar_t>(ap[sp[j]] - sv[j]);
          });
        });
      } else {
        scatter_into(up, numel, ip, vp, n, divisor, false);
        residual_into(rp, ap, numel, sp, sv, ns, false);
      }
    });
  });
  return {update, res};
}

}  // namespace cpu
}  // namespace gtopk
