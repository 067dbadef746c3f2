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
#include <cstddef>
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
// order, calling body(index, union value, code) once per union entry; code
// says which operands the entry came from (1: a, 2: b, 3: both, an equal
// index).  While both operands have entries left the step is branch-free
// (which operand comes next is a coin toss on random index sets: a
// mispredicted branch per entry was most of a round's merge time).
template <typename scalar_t, typename index_t, typename F>
inline void walk_union(const index_t* ia, const scalar_t* va, int64_t i, int64_t ie,
                       const index_t* ib, const scalar_t* vb, int64_t j, int64_t je, const F& body) {
  while (i < ie && j < je) {
    const int64_t a = static_cast<int64_t>(ia[i]), b = static_cast<int64_t>(ib[j]);
    const bool lt = a < b, gt = b < a;
    const scalar_t x = add0(va[i]), y = add0(vb[j]);
    const scalar_t sum = static_cast<scalar_t>(x + vb[j]);  // equal index: (0 + a) + b
    body(static_cast<index_t>(lt ? a : b), pick(lt, x, pick(gt, y, sum)),
         static_cast<uint8_t>(static_cast<uint8_t>(!gt) | (static_cast<uint8_t>(!lt) << 1)));
    i += !gt;
    j += !lt;
  }
  for (; i < ie; ++i) body(ia[i], add0(va[i]), uint8_t(1));
  for (; j < je; ++j) body(ib[j], add0(vb[j]), uint8_t(2));
}

// Per-thread scratch that only grows: the stored union of a round is a few
// MB (25M entries at 1 %: 500k entries, 9 bytes each), and a fresh
// allocation of that size is served by mmap, its pages faulted in on every
// call -- a third of the merge's time (issue #15).  Held by the calling
// thread for the process's life, at most the largest union it merged.
class Scratch {
 public:
  void* get(size_t bytes) {
    if (bytes > cap_) {
      buf_.reset(new std::max_align_t[(bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t)]);
      cap_ = bytes;
    }
    return buf_.get();
  }

 private:
  std::unique_ptr<std::max_align_t[]> buf_;
  size_t cap_ = 0;
};

// The histogram's digit: a key's top 12 bits, 4096 bins (16 KB, in L1);
// for a 16-bit type, the top 12 of its key's 15.
template <typename scalar_t>
struct Digit {
  static constexpr int kBits = Mag<scalar_t>::kBits < 12 ? Mag<scalar_t>::kBits : 12;
  static constexpr int kShift = Mag<scalar_t>::kBits - kBits;
  static constexpr int64_t kBins = int64_t(1) << kBits;
};

// What the walk of one segment leaves for its emit pass.
template <typename K>
struct SegmentCut {
  int64_t k = 0;     // the segment's k (negative requests clamped to 0)
  int64_t n = 0;     // union size
  K thr = K(0);      // the k-th largest key (when n > k > 0)
  int64_t ties = 0;  // how many entries with key == thr are kept (the first ones)
};

// The walk of one segment (operand ranges [i, ie) and [j, je)), the only
// step of the merge with a dependent chain (the next positions depend on
// this comparison): it stores the union at ui/uv/uc (index, value, source
// code) in index order, with a histogram of the keys' top digits on the
// side, and finds the k-th largest key T within the histogram's one bucket
// that holds it (a radix select over that bucket's keys only: one bin of
// 4096, instead of radix passes over the whole union).  Two lanes walked
// in lockstep (the segment split at a pivot index, to overlap two chains)
// took longer, 4.8 ms against 4.1 (250k + 250k).
template <typename scalar_t, typename index_t>
SegmentCut<typename Mag<scalar_t>::key_t> union_segment(
    const index_t* ia, const scalar_t* va, int64_t i, int64_t ie, const index_t* ib,
    const scalar_t* vb, int64_t j, int64_t je, int64_t k, index_t* ui, scalar_t* uv, uint8_t* uc,
    uint32_t* h) {
  using K = typename Mag<scalar_t>::key_t;
  using D = Digit<scalar_t>;
  std::fill(h, h + D::kBins, 0u);
  int64_t n = 0;
  walk_union(ia, va, i, ie, ib, vb, j, je, [&](index_t idx, scalar_t v, uint8_t code) {
    ui[n] = idx;
    uv[n] = v;
    uc[n] = code;
    ++h[key_of(v) >> D::kShift];
    ++n;
  });
  SegmentCut<K> cut;
  cut.k = k;
  cut.n = n;
  if (n > k && k > 0) {
    // the bucket d holding the k-th largest key; `above` keys lie in higher buckets
    int64_t above = 0, d = D::kBins - 1;
    for (; d > 0 && above + h[d] < k; --d) above += h[d];
    const int64_t m = h[d];
    std::unique_ptr<K[]> bucket(new K[m + 1]);  // + 1: the branch-free append's last spare write
    int64_t w = 0;
    for (int64_t q = 0; q < n; ++q) {
      const K kk = key_of(uv[q]);
      bucket[w] = kk;
      w += static_cast<int64_t>(kk >> D::kShift) == d;
    }
    const K T = kth_largest_radix(bucket.get(), m, k - above);
    int64_t gt = above;
    for (int64_t q = 0; q < m; ++q) gt += bucket[q] > T;
    cut.thr = T;
    cut.ties = k - gt;
  }
  return cut;
}

// The emit pass of one segment over its stored union: survivors into
// oi/ov[w, end) and the keep flags of both operands' entries (ka, kb: the
// segment's first entries), branch-free.
template <typename scalar_t, typename index_t>
void emit_segment(const index_t* ui, const scalar_t* uv, const uint8_t* uc,
                  SegmentCut<typename Mag<scalar_t>::key_t> cut, bool* ka, bool* kb, index_t* oi,
                  scalar_t* ov, int64_t w, int64_t end) {
  using K = typename Mag<scalar_t>::key_t;
  const int64_t n = cut.n, k = cut.k;
  const bool all = n <= k, none = k == 0;
  const K T = cut.thr;
  int64_t left = cut.ties, pa = 0, pb = 0;
  index_t spare_i;  // where a step that keeps nothing writes once w == end
  scalar_t spare_v;
  bool spare_k;     // where the flag of an operand the entry did not come from goes
  for (int64_t q = 0; q < n; ++q) {
    // keep = all, or key > T, or a tie at T while ties are left (the
    // first, smallest-index, ones)
    const scalar_t v = uv[q];
    const K kk = key_of(v);
    const bool tie = !all && !none && kk == T && left > 0;
    const bool keep = all || (!none && kk > T) || tie;
    left -= tie;
    const uint8_t c = uc[q];
    *((c & 1) ? ka + pa : &spare_k) = keep;
    *((c & 2) ? kb + pb : &spare_k) = keep;
    pa += c & 1;
    pb += c >> 1;
    const bool room = w < end;
    *(room ? oi + w : &spare_i) = ui[q];
    *(room ? ov + w : &spare_v) = v;
    w += keep;
  }
}

// The merge of one round: per segment, one walk that stores the union and
// finds the k-th largest key (union_segment), then one linear pass over the
// stored union (emit_segment) that writes the survivors and both keep flags
// -- no second walk, no comparison chain in it (issue #15: the two-walk
// version spent two thirds of its time in the walks).
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
  // The stored union in the thread's scratch (uninitialised: every slot
  // used is written first): values, then indices, then codes, each array
  // aligned for its type; segment s starts at ab[s] + bb[s].
  const size_t cap = static_cast<size_t>(std::max<int64_t>(1, na + nb));
  const size_t vb_bytes = (cap * sizeof(scalar_t) + 7) & ~size_t(7);
  const size_t ib_bytes = (cap * sizeof(index_t) + 7) & ~size_t(7);
  thread_local Scratch scratch;
  char* mem = static_cast<char*>(scratch.get(vb_bytes + ib_bytes + cap));
  scalar_t* const uval = reinterpret_cast<scalar_t*>(mem);
  index_t* const uidx = reinterpret_cast<index_t*>(mem + vb_bytes);
  uint8_t* const ucode = reinterpret_cast<uint8_t*>(mem + vb_bytes + ib_bytes);
  std::vector<SegmentCut<K>> cut(static_cast<size_t>(S));
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    std::vector<uint32_t> hist(static_cast<size_t>(Digit<scalar_t>::kBins));
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t base = ab[s] + bb[s];
      cut[s] = union_segment(ia, va, ab[s], ab[s + 1], ib, vb, bb[s], bb[s + 1],
                             std::max<int64_t>(0, ks[s]), uidx + base, uval + base, ucode + base,
                             hist.data());
    }
  });
  std::vector<int64_t> start(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) start[s + 1] = start[s] + std::min(cut[s].n, cut[s].k);
  out_idx = at::empty({start[S]}, out_idx.options());
  out_val = at::empty({start[S]}, out_val.options());
  index_t* oi = out_idx.data_ptr<index_t>();
  scalar_t* ov = out_val.data_ptr<scalar_t>();
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t base = ab[s] + bb[s];
      emit_segment(uidx + base, uval + base, ucode + base, cut[s],
                   keep_a + ab[s], keep_b + bb[s], oi, ov, start[s], start[s + 1]);
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
