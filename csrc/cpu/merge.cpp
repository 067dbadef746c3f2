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
#include <cstring>
#include <memory>
#include <type_traits>

namespace gtopk {
namespace cpu {
namespace {

// zeros + v, as torch.zeros(...).index_add_ computes it (-0.0 -> +0.0).
template <typename T>
inline T add0(T v) {
  T z = T(0.0f);
  return static_cast<T>(z + v);
}

// c ? x : y on the bits, without a branch (a float ternary may compile to
// one, and which operand is taken is a coin toss on random index sets).
template <typename T>
inline T pick(bool c, T x, T y) {
  using U = UBits<T>;
  U bx, by;
  std::memcpy(&bx, &x, sizeof(T));
  std::memcpy(&by, &y, sizeof(T));
  const U m = static_cast<U>(0) - static_cast<U>(c);
  const U r = static_cast<U>((bx & m) | (by & static_cast<U>(~m)));
  T out;
  std::memcpy(&out, &r, sizeof(T));
  return out;
}

// Walk the union of operand ranges [i, ie) and [j, je) in ascending index
// order, calling body(index, union value, position in a, position in b) once
// per union entry.  While both operands have entries left the step is
// branch-free (which operand comes next is a coin toss on random index sets:
// a mispredicted branch per entry was most of a round's merge time), and
// body gets both current positions, i < ie and j < je, whichever entries the
// step consumes: it may write per-position flags of both operands
// unconditionally, since a flag written for an entry the step did not
// consume is overwritten at the step that does.  On the tail (one operand
// left) the other position is -1.
template <typename scalar_t, typename index_t, typename F>
inline void walk_union(const index_t* ia, const scalar_t* va, int64_t i, int64_t ie,
                       const index_t* ib, const scalar_t* vb, int64_t j, int64_t je, const F& body) {
  while (i < ie && j < je) {
    const int64_t a = static_cast<int64_t>(ia[i]), b = static_cast<int64_t>(ib[j]);
    const bool lt = a < b, gt = b < a;
    const scalar_t x = add0(va[i]), y = add0(vb[j]);
    const scalar_t sum = static_cast<scalar_t>(x + vb[j]);  // equal index: (0 + a) + b
    body(static_cast<index_t>(lt ? a : b), pick(lt, x, pick(gt, y, sum)), i, j);
    i += !gt;
    j += !lt;
  }
  for (; i < ie; ++i) body(ia[i], add0(va[i]), i, int64_t(-1));
  for (; j < je; ++j) body(ib[j], add0(vb[j]), int64_t(-1), j);
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
      const int64_t end = start[s + 1];
      index_t spare_i;  // where a step that keeps nothing writes once w == end
      scalar_t spare_v;
      walk_union(ia, va, ab[s], ab[s + 1], ib, vb, bb[s], bb[s + 1],
                 [&](index_t idx, scalar_t v, int64_t pa, int64_t pb) {
                   // branch-free: keep = all, or key > T, or a tie at T
                   // while ties are left (the first, smallest-index, ones)
                   const K kk = key_of(v);
                   const bool tie = !all && !none && kk == T && left > 0;
                   const bool keep = all || (!none && kk > T) || tie;
                   left -= tie;
                   if (pa >= 0) keep_a[pa] = keep;  // in the two-operand loop: always
                   if (pb >= 0) keep_b[pb] = keep;
                   const bool room = w < end;
                   *(room ? oi + w : &spare_i) = idx;
                   *(room ? ov + w : &spare_v) = v;
                   w += keep;
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
