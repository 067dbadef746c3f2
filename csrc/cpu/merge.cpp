// Merge-and-select of two sparse sets (one gTop-k butterfly round).
//
// Operands are (ascending, unique) global indices with values.  The union sums
// values on equal indices exactly as the reference does (zeros, then operand
// a, then operand b, each addition rounded to the value dtype: -0.0 becomes
// +0.0, and IEEE addition of two operands is commutative, so both partners of
// a round get the same bits).  Per segment the union keeps its top-k under the
// tie rule; keep_a / keep_b say which entries of each operand survived.
#include "common.h"
#include "ops.h"

#include <functional>

namespace gtopk {
namespace cpu {
namespace {

// zeros + v, as torch.zeros(...).index_add_ computes it (-0.0 -> +0.0).
template <typename T>
inline T add0(T v) {
  T z = T(0.0f);
  return static_cast<T>(z + v);
}

template <typename scalar_t, typename index_t>
void merge_impl(const index_t* ia, const scalar_t* va, int64_t na, const index_t* ib,
                const scalar_t* vb, int64_t nb, const int64_t* o, const int64_t* ks, int64_t S,
                bool* keep_a, bool* keep_b, at::Tensor& out_idx, at::Tensor& out_val) {
  using K = typename Mag<scalar_t>::key_t;
  // Operand ranges of every segment.
  std::vector<int64_t> ab(S + 1), bb(S + 1);
  for (int64_t s = 0; s <= S; ++s) {
    ab[s] = std::lower_bound(ia, ia + na, o[s]) - ia;
    bb[s] = std::lower_bound(ib, ib + nb, o[s]) - ib;
  }
  TORCH_CHECK(ab[0] == 0 && ab[S] == na && bb[0] == 0 && bb[S] == nb,
              "merge_select: indices must lie within [offsets[0], offsets[-1])");
  const int64_t nu = na + nb;
  std::vector<int64_t> u_idx(nu), u_a(nu), u_b(nu);
  std::vector<scalar_t> u_val(nu);
  std::vector<uint8_t> u_keep(nu);
  std::vector<int64_t> u_n(S, 0), kept(S, 0);

  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    std::vector<K> keys;
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t base = ab[s] + bb[s];
      int64_t i = ab[s], j = bb[s], u = base;
      const int64_t ie = ab[s + 1], je = bb[s + 1];
      while (i < ie || j < je) {
        if (j >= je || (i < ie && static_cast<int64_t>(ia[i]) < static_cast<int64_t>(ib[j]))) {
          u_idx[u] = ia[i];
          u_val[u] = add0(va[i]);
          u_a[u] = i++;
          u_b[u] = -1;
        } else if (i >= ie || static_cast<int64_t>(ib[j]) < static_cast<int64_t>(ia[i])) {
          u_idx[u] = ib[j];
          u_val[u] = add0(vb[j]);
          u_a[u] = -1;
          u_b[u] = j++;
        } else {  // equal index: (0 + a) + b
          u_idx[u] = ia[i];
          u_val[u] = static_cast<scalar_t>(add0(va[i]) + vb[j]);
          u_a[u] = i++;
          u_b[u] = j++;
        }
        ++u;
      }
      const int64_t n = u - base;
      const int64_t k = std::max<int64_t>(0, ks[s]);
      u_n[s] = n;
      if (n <= k) {
        std::fill(u_keep.begin() + base, u_keep.begin() + base + n, uint8_t(1));
        kept[s] = n;
      } else if (k == 0) {
        std::fill(u_keep.begin() + base, u_keep.begin() + base + n, uint8_t(0));
      } else {
        keys.resize(n);
        for (int64_t q = 0; q < n; ++q) keys[q] = key_of(u_val[base + q]);
        std::vector<K> sel(keys);
        std::nth_element(sel.begin(), sel.begin() + (k - 1), sel.end(), std::greater<K>());
        const K T = sel[k - 1];
        int64_t gt = 0;
        for (K kk : keys) gt += kk > T;
        const int64_t ties = k - gt;
        int64_t taken = 0;
        for (int64_t q = 0; q < n; ++q) {
          const K kk = keys[q];
          u_keep[base + q] = (kk > T || (kk == T && taken++ < ties)) ? 1 : 0;
        }
        kept[s] = k;
      }
      for (int64_t q = base; q < base + n; ++q) {
        if (u_a[q] >= 0) keep_a[u_a[q]] = u_keep[q] != 0;
        if (u_b[q] >= 0) keep_b[u_b[q]] = u_keep[q] != 0;
      }
    }
  });

  std::vector<int64_t> start(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) start[s + 1] = start[s] + kept[s];
  out_idx = at::empty({start[S]}, out_idx.options());
  out_val = at::empty({start[S]}, out_val.options());
  index_t* oi = out_idx.data_ptr<index_t>();
  scalar_t* ov = out_val.data_ptr<scalar_t>();
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      int64_t w = start[s];
      const int64_t base = ab[s] + bb[s];
      for (int64_t q = base; q < base + u_n[s]; ++q) {
        if (u_keep[q]) {
          oi[w] = static_cast<index_t>(u_idx[q]);
          ov[w] = u_val[q];
          ++w;
        }
      }
    }
  });
}

}  // namespace

bool strictly_increasing(const at::Tensor& idx_) {
  TORCH_CHECK(idx_.dim() == 1, "strictly_increasing: 1-D indices expected");
  const at::Tensor idx = idx_.contiguous();
  return GTOPK_DISPATCH_INDEX(idx.scalar_type(), "strictly_increasing", [&] {
    const index_t* p = idx.data_ptr<index_t>();
    const int64_t n = idx.numel();
    for (int64_t i = 1; i < n; ++i)
      if (p[i] <= p[i - 1]) return false;
    return true;
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_select(
    const at::Tensor& idx_a_, const at::Tensor& val_a_, const at::Tensor& idx_b_,
    const at::Tensor& val_b_, const at::Tensor& offsets, const at::Tensor& k) {
  TORCH_CHECK(idx_a_.dim() == 1 && idx_b_.dim() == 1 && val_a_.dim() == 1 && val_b_.dim() == 1,
              "merge_select: 1-D operands expected");
  TORCH_CHECK(idx_a_.numel() == val_a_.numel() && idx_b_.numel() == val_b_.numel(),
              "merge_select: indices and values differ in length");
  TORCH_CHECK(idx_a_.scalar_type() == idx_b_.scalar_type(),
              "merge_select: both index tensors must have one dtype");
  TORCH_CHECK(val_a_.scalar_type() == val_b_.scalar_type(),
              "merge_select: both value tensors must have one dtype");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && k.scalar_type() == at::kLong &&
                  offsets.numel() == k.numel() + 1,
              "merge_select: offsets (S+1) and k (S) must be int64");
  const at::Tensor ia = idx_a_.contiguous(), ib = idx_b_.contiguous();
  const at::Tensor va = val_a_.contiguous(), vb = val_b_.contiguous();
  const at::Tensor off = offsets.contiguous(), kk = k.contiguous();
  const int64_t S = kk.numel();
  at::Tensor keep_a = at::empty({ia.numel()}, ia.options().dtype(at::kBool));
  at::Tensor keep_b = at::empty({ib.numel()}, ib.options().dtype(at::kBool));
  at::Tensor out_idx = at::empty({0}, ia.options());
  at::Tensor out_val = at::empty({0}, va.options());
  GTOPK_DISPATCH_VALUES(va.scalar_type(), "merge_select", [&] {
    GTOPK_DISPATCH_INDEX(ia.scalar_type(), "merge_select", [&] {
      merge_impl<scalar_t, index_t>(ia.data_ptr<index_t>(), va.data_ptr<scalar_t>(), ia.numel(),
                                    ib.data_ptr<index_t>(), vb.data_ptr<scalar_t>(), ib.numel(),
                                    off.data_ptr<int64_t>(), kk.data_ptr<int64_t>(), S,
                                    keep_a.data_ptr<bool>(), keep_b.data_ptr<bool>(), out_idx,
                                    out_val);
    });
  });
  return {out_idx, out_val, keep_a, keep_b};
}

}  // namespace cpu
}  // namespace gtopk
