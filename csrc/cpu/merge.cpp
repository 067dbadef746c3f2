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
#include <memory>

namespace gtopk {
namespace cpu {
namespace {

// zeros + v, as torch.zeros(...).index_add_ computes it (-0.0 -> +0.0).
template <typename T>
inline T add0(T v) {
  T z = T(0.0f);
  return static_cast<T>(z + v);
}

// Walk the union of operand ranges [i, ie) and [j, je) in ascending index
// order, calling body(index, union value, position in a or -1, in b or -1).
template <typename scalar_t, typename index_t, typename F>
inline void walk_union(const index_t* ia, const scalar_t* va, int64_t i, int64_t ie,
                       const index_t* ib, const scalar_t* vb, int64_t j, int64_t je, const F& body) {
  while (i < ie || j < je) {
    if (j >= je || (i < ie && static_cast<int64_t>(ia[i]) < static_cast<int64_t>(ib[j]))) {
      body(ia[i], add0(va[i]), i, int64_t(-1));
      ++i;
    } else if (i >= ie || static_cast<int64_t>(ib[j]) < static_cast<int64_t>(ia[i])) {
      body(ib[j], add0(vb[j]), int64_t(-1), j);
      ++j;
    } else {  // equal index: (0 + a) + b
      body(ia[i], static_cast<scalar_t>(add0(va[i]) + vb[j]), i, j);
      ++i;
      ++j;
    }
  }
}

// Two walks over the union per segment, nothing per union entry kept but its
// magnitude key: walk 1 finds the union size and the k-th largest key T (and
// how many entries equal to T are taken: the first ones, i.e. the smallest
// indices); walk 2 recomputes the same sums and writes the survivors and the
// keep flags straight into the outputs.
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
  // Walk 1 (the key buffer is uninitialised on purpose: every slot used is
  // written first).
  std::unique_ptr<K[]> keys(new K[std::max<int64_t>(1, na + nb)]);
  std::vector<int64_t> u_n(S, 0), kept(S, 0), ties(S, 0);
  std::vector<K> thr(S, K(0));
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      K* kp = keys.get() + ab[s] + bb[s];
      int64_t n = 0;
      walk_union(ia, va, ab[s], ab[s + 1], ib, vb, bb[s], bb[s + 1],
                 [&](index_t, scalar_t v, int64_t, int64_t) { kp[n++] = key_of(v); });
      const int64_t k = std::max<int64_t>(0, ks[s]);
      u_n[s] = n;
      kept[s] = std::min(n, k);
      if (n > k && k > 0) {
        const K T = kth_largest_radix(kp, n, k);
        int64_t gt = 0;
        for (int64_t q = 0; q < n; ++q) gt += kp[q] > T;
        thr[s] = T;
        ties[s] = k - gt;
      }
    }
  });
  std::vector<int64_t> start(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) start[s + 1] = start[s] + kept[s];
  out_idx = at::empty({start[S]}, out_idx.options());
  out_val = at::empty({start[S]}, out_val.options());
  index_t* oi = out_idx.data_ptr<index_t>();
  scalar_t* ov = out_val.data_ptr<scalar_t>();
  // Walk 2.
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t k = std::max<int64_t>(0, ks[s]);
      const bool all = u_n[s] <= k, none = k == 0;
      const K T = thr[s];
      int64_t left = ties[s], w = start[s];
      walk_union(ia, va, ab[s], ab[s + 1], ib, vb, bb[s], bb[s + 1],
                 [&](index_t idx, scalar_t v, int64_t pa, int64_t pb) {
                   bool keep;
                   if (all) {
                     keep = true;
                   } else if (none) {
                     keep = false;
                   } else {  // ties at T: the first (smallest-index) ones
                     const K kk = key_of(v);
                     keep = kk > T || (kk == T && left-- > 0);
                   }
                   if (pa >= 0) keep_a[pa] = keep;
                   if (pb >= 0) keep_b[pb] = keep;
                   if (keep) {
                     oi[w] = idx;
                     ov[w] = v;
                     ++w;
                   }
                 });
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

// member_sorted(values, ascending)[i]: values[i] occurs in `ascending`;
// both ascending (the caller checks), one merge-like walk, O(n + m): the
// survival test of a worker's own entries after each butterfly round,
// without a binary search (cache miss) per entry.
at::Tensor member_sorted(const at::Tensor& values_, const at::Tensor& ascending_) {
  TORCH_CHECK(values_.dim() == 1 && ascending_.dim() == 1 &&
                  values_.scalar_type() == ascending_.scalar_type(),
              "member_sorted: two 1-D index tensors of one dtype expected");
  const at::Tensor v = values_.contiguous(), a = ascending_.contiguous();
  at::Tensor out = at::empty({v.numel()}, v.options().dtype(at::kBool));
  bool* o = out.data_ptr<bool>();
  GTOPK_DISPATCH_INDEX(v.scalar_type(), "member_sorted", [&] {
    const index_t* pv = v.data_ptr<index_t>();
    const index_t* pa = a.data_ptr<index_t>();
    const int64_t n = v.numel(), m = a.numel();
    int64_t j = 0;
    for (int64_t i = 0; i < n; ++i) {
      while (j < m && pa[j] < pv[i]) ++j;
      o[i] = j < m && pa[j] == pv[i];
    }
  });
  return out;
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
