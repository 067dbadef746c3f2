// Segmented exact top-k and threshold selection on CPU.
//
// x is a flat buffer cut into S segments by `offsets`; segment s selects
// k[s] entries.  Results are global indices (int32 unless x.numel() exceeds
// int32), ascending, and the selected values.  The result of each kernel is
// uniquely defined (exact top-k under the tie rule; the threshold rule of
// reference.py), so it does not depend on the number of threads or on the
// internal path taken.
//
// Exact top-k of one segment (n entries, 0 < k < n) in three steps:
//   1. a lower bound L on the k-th largest key T with count(key >= L) a little
//      over k: from a sample of whole cache lines (no pass over x), or, when
//      the sample cannot give one (dense k, heavy ties, a failed estimate),
//      from a radix histogram of the top key bits (one pass; refined by the
//      next bits while the bucket holding T is large);
//   2. one streaming pass collecting the candidates key >= L (positions and
//      value bits, per thread range, in index order; SIMD compares);
//   3. T and the number of ties at T that fit, by selection over the
//      candidates only (heap / nth_element, or radix histograms when there
//      are many); then every candidate above T and the first ties in index
//      order are written out, with their values.
// Work is split across segments (small ones, balanced by size) and within
// segments (large ones) with at::parallel_for.
#include "common.h"
#include "ops.h"

#include <atomic>
#include <cmath>
#include <functional>
#include <memory>
#include <mutex>
#include <type_traits>

namespace gtopk {
namespace cpu {
namespace {

constexpr int64_t kSmall = 4096;         // segments up to this size: one in-cache pass
constexpr int64_t kBlock = 1 << 16;      // elements per collect block
constexpr int64_t kSub = 2048;           // two-phase sub-block of the fused collect (g and r in L1)
constexpr int64_t kSampleRun = 128;     // the sampled bound reads runs of this many entries
// At most this many sampled entries per segment: the bound's margin over k
// shrinks as 1/sqrt(sample) (1.55k candidates at 1 % with 8192, 1.25k with
// 32768), and every candidate costs a store, a key compare and a write-out,
// where the sample costs 256 scattered runs (issue #15)
constexpr int64_t kSampleMax = 32768;
constexpr int64_t kRefSample = 4096;     // reference.THRESHOLD_SAMPLE
constexpr int64_t kRefRun = 128;         // reference.THRESHOLD_RUN
constexpr double kTolerance = 0.10;      // reference.THRESHOLD_TOLERANCE
constexpr double kBias = 2.0;            // reference.THRESHOLD_BIAS

// An allocator whose resize() leaves new elements uninitialised: the fused
// collect grows its candidate arrays ahead of the writes (room for every hit
// of a sub-block) and shrinks them after, so zero-filling that room cost a
// memset per sub-block (issue #15).
template <typename T>
struct NoInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = NoInitAllocator<U>;
  };
  NoInitAllocator() = default;
  template <typename U>
  NoInitAllocator(const NoInitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* q) noexcept {
    ::new (static_cast<void*>(q)) U;  // default-initialised: trivial types stay unwritten
  }
  template <typename U, typename... A>
  void construct(U* q, A&&... a) {
    ::new (static_cast<void*>(q)) U(std::forward<A>(a)...);
  }
};
template <typename T>
using RawVector = std::vector<T, NoInitAllocator<T>>;

// Candidates: positions (segment-local, ascending) and the raw bits of their
// values (the key is recomputed from them, and the value is written out
// without a second, random, read of x).
template <typename M>
struct Cands {
  using K = typename M::key_t;
  RawVector<int64_t> pos;
  RawVector<typename M::bits_t> bits;
  int64_t size() const { return static_cast<int64_t>(pos.size()); }
  K key(int64_t j) const { return M::key(bits[j]); }
};

// Candidates of p[0, n) with key >= L, in position order, into `out`.  With
// kTies, L is the exact k-th key and at most `eq_cap` entries equal to L are
// kept per thread range (only the first eq_cap of them, in index order, can be
// selected).  Gives up (returns false) once more than `cap` were collected.
// Writes x[s, e) (segment-local) before it is read: the fused
// compensation (acc = grad + residual) of compensate_select_topk.
using Producer = std::function<void(int64_t, int64_t)>;
// A producer that also scans what it writes: fc(s, e, L, c) writes x[s, e)
// and appends its entries with key >= L to c in position order (float32:
// compensate_collect_f32, one loop, non-temporal stores).
template <typename M>
using FusedCollect = std::function<void(int64_t, int64_t, typename M::key_t, Cands<M>&)>;

template <typename M, bool kTies>
bool collect(const typename M::bits_t* p, int64_t n, typename M::key_t L, int64_t eq_cap,
             int64_t cap, Cands<M>& out, const Producer* produce = nullptr,
             const FusedCollect<M>* fc = nullptr, int64_t reserve = 0) {
  using K = typename M::key_t;
  const int64_t nblk = (n + kBlock - 1) / kBlock;
  std::atomic<int64_t> total{0};
  std::atomic<bool> stop{false};
  // Appends the candidates of p[s, e) to c; false once past `cap` in all.
  auto scan = [&](int64_t s, int64_t e, Cands<M>& c, int64_t& eq_seen) {
    auto take = [&](int64_t i, K kk) {
      if (kTies && kk == L) {
        if (eq_seen++ >= eq_cap) return;
      }
      c.pos.push_back(i);
      c.bits.push_back(p[i]);
    };
    const size_t before = c.pos.size();
    int64_t i = s;
    for (; i + 16 <= e; i += 16) {
      uint32_t mk = Scan<M>::mask16(p + i, L);  // SIMD test; usually 0
      while (mk) {
        const int j = __builtin_ctz(mk);
        mk &= mk - 1;
        const K kk = M::key(p[i + j]);
        if (kk >= L) take(i + j, kk);
      }
    }
    for (; i < e; ++i) {
      const K kk = M::key(p[i]);
      if (kk >= L) take(i, kk);
    }
    const int64_t added = static_cast<int64_t>(c.pos.size() - before);
    if (added && total.fetch_add(added, std::memory_order_relaxed) + added > cap) {
      stop.store(true, std::memory_order_relaxed);
      return false;
    }
    return true;
  };
  // One block into dst: written and scanned in one loop (fc) while under
  // the cap; otherwise written (produce) -- with a producer every block is
  // written even after giving up, since the fallback paths read the whole,
  // compensated, buffer -- then scanned unless past the cap.
  auto visit = [&](int64_t blk, Cands<M>& dst) {
    const int64_t s0 = blk * kBlock, e0 = std::min(n, (blk + 1) * kBlock);
    if (fc != nullptr && !stop.load(std::memory_order_relaxed)) {
      const int64_t before = dst.size();
      (*fc)(s0, e0, L, dst);
      const int64_t added = dst.size() - before;
      if (added && total.fetch_add(added, std::memory_order_relaxed) + added > cap)
        stop.store(true, std::memory_order_relaxed);
      return;
    }
    if (produce != nullptr) (*produce)(s0, e0);
    if (stop.load(std::memory_order_relaxed)) return;
    int64_t unused = 0;
    scan(s0, e0, dst, unused);
  };
  const bool serial = at::get_num_threads() <= 1 || at::in_parallel_region() || nblk <= 1;
  if (!kTies && serial) {
    // one thread: the blocks in order straight into `out` (no per-block
    // slots to concatenate afterwards: one copy of every candidate less)
    if (reserve > 0) {
      out.pos.reserve(reserve * nblk);
      out.bits.reserve(reserve * nblk);
    }
    for (int64_t blk = 0; blk < nblk; ++blk) visit(blk, out);
    return !stop.load();
  }
  std::vector<Cands<M>> part(nblk);  // candidates of each block (or thread range)
  if (!kTies) {
    // blocks handed out dynamically, each into its own slot
    parallel_dynamic(nblk, [&](int64_t, int64_t blk) {
      if (reserve > 0) {
        part[blk].pos.reserve(reserve);
        part[blk].bits.reserve(reserve);
      }
      visit(blk, part[blk]);
    });
  } else {
    TORCH_INTERNAL_ASSERT(produce == nullptr, "gtopk collect: no producer on the ties path");
    // ties capped per contiguous thread range (bounded memory: at most
    // eq_cap equal keys per range, and ranges are in index order)
    at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
      int64_t eq_seen = 0;
      for (int64_t blk = b0; blk < b1; ++blk) {
        if (stop.load(std::memory_order_relaxed)) return;
        if (!scan(blk * kBlock, std::min(n, (blk + 1) * kBlock), part[b0], eq_seen)) return;
      }
    });
  }
  if (stop.load()) return false;
  std::vector<int64_t> start(nblk + 1, 0);
  for (int64_t b = 0; b < nblk; ++b) start[b + 1] = start[b] + part[b].size();
  out.pos.resize(start[nblk]);
  out.bits.resize(start[nblk]);
  parallel_dynamic(nblk, [&](int64_t, int64_t b) {
    std::copy(part[b].pos.begin(), part[b].pos.end(), out.pos.begin() + start[b]);
    std::copy(part[b].bits.begin(), part[b].bits.end(), out.bits.begin() + start[b]);
  });
  return true;
}

// out[b, e) = g[b, e) (+ r[b, e)) for float32 and every entry with key >= L
// appended to c (position i + shift, the sum's bits), in one loop: the sums
// are compared in registers, so the accumulator is never read back.  With
// kStream (a large accumulator, which no cache holds until its next use)
// it is written with non-temporal stores, so its lines are not first read
// for ownership either (issue #15: 3 transfers of N instead of 4).  Bit for bit
// compensate_range + collect (one IEEE addition per element).  Returns
// whether the sums out[b, e) are all finite.
template <bool kRes, bool kStream>
bool compensate_collect_f32(float* out, const float* g, const float* r, int64_t b, int64_t e,
                            uint32_t L, int64_t shift, Cands<Mag<float>>& c) {
  using M = Mag<float>;
  using E = ExpBits<float>;
  uint32_t bad = 0;
  auto one = [&](int64_t i) {
    const float v = kRes ? g[i] + r[i] : g[i];
    out[i] = v;
    uint32_t vb;
    std::memcpy(&vb, &v, sizeof(vb));
    bad |= (vb & E::kExp) + E::kLsb;  // the sum: a residual's overflow too
    if (M::key(vb) >= L) {
      c.pos.push_back(i + shift);
      c.bits.push_back(vb);
    }
  };
  int64_t i = b;
#if defined(__SSE2__)
  for (; i < e && (reinterpret_cast<uintptr_t>(out + i) & 15) != 0; ++i) one(i);
  const __m128i expm = _mm_set1_epi32(static_cast<int32_t>(E::kExp));
  const __m128i lsb = _mm_set1_epi32(static_cast<int32_t>(E::kLsb));
  const __m128i absm = _mm_set1_epi32(0x7FFFFFFF);
  const __m128i lm1 = _mm_set1_epi32(static_cast<int32_t>(L) - 1);
  __m128i badv = _mm_setzero_si128();
  // Two phases per sub-block of kSub entries (issue #15).  Phase 1 streams:
  // sums, stores and compares with no data-dependent branch -- it records
  // each group of 16's hit mask and, branch-free, the list of groups that
  // hit -- so a mispredicted "any candidate here?" branch (one group in six
  // at 1 % density) never stalls the stream.  Phase 2 walks only the listed
  // groups and recomputes their sums from g and r, still in L1 (the stored
  // sums went out non-temporally): the same IEEE addition, the same bits.
  constexpr int kGroups = static_cast<int>(kSub / 16);
  alignas(16) uint16_t masks[kGroups];
  uint16_t hit_groups[kGroups];
  int64_t n = c.size();
  for (; i + kSub <= e; i += kSub) {
    int nh = 0;
    for (int grp = 0; grp < kGroups; ++grp) {
      const int64_t o = i + 16 * grp;
      uint32_t mk = 0;
      for (int q = 0; q < 4; ++q) {
        const __m128 gv = _mm_loadu_ps(g + o + 4 * q);
        const __m128 v = kRes ? _mm_add_ps(gv, _mm_loadu_ps(r + o + 4 * q)) : gv;
        badv = _mm_or_si128(badv, _mm_add_epi32(_mm_and_si128(_mm_castps_si128(v), expm), lsb));
        if (kStream) {
          _mm_stream_ps(out + o + 4 * q, v);
        } else {
          _mm_store_ps(out + o + 4 * q, v);
        }
        const __m128i hit = _mm_cmpgt_epi32(_mm_and_si128(_mm_castps_si128(v), absm), lm1);
        mk |= static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(hit))) << (4 * q);
      }
      masks[grp] = static_cast<uint16_t>(mk);
      hit_groups[nh] = static_cast<uint16_t>(grp);
      nh += mk != 0;
    }
    if (nh == 0) continue;
    const int64_t need = n + 16 * static_cast<int64_t>(nh);
    if (need > static_cast<int64_t>(c.pos.size())) {  // room for every hit, written by pointer
      const size_t grow = static_cast<size_t>(std::max<int64_t>(need, 2 * static_cast<int64_t>(c.pos.size())));
      c.pos.resize(grow);
      c.bits.resize(grow);
    }
    int64_t* pos = c.pos.data();
    uint32_t* bits = c.bits.data();
    for (int t = 0; t < nh; ++t) {
      const int64_t o = i + 16 * hit_groups[t];
      uint32_t mk = masks[hit_groups[t]];
      do {
        const int j = __builtin_ctz(mk);
        mk &= mk - 1;
        const float v = kRes ? g[o + j] + r[o + j] : g[o + j];  // key >= L exactly (NaN bits too)
        pos[n] = o + j + shift;
        std::memcpy(bits + n, &v, sizeof(uint32_t));
        ++n;
      } while (mk);
    }
  }
  c.pos.resize(static_cast<size_t>(n));
  c.bits.resize(static_cast<size_t>(n));
  for (; i + 16 <= e; i += 16) {  // the last groups of 16, as one per-group pass
    __m128 v[4];
    __m128i hit[4];
    for (int q = 0; q < 4; ++q) {
      const __m128 gv = _mm_loadu_ps(g + i + 4 * q);
      v[q] = kRes ? _mm_add_ps(gv, _mm_loadu_ps(r + i + 4 * q)) : gv;
      badv = _mm_or_si128(badv, _mm_add_epi32(_mm_and_si128(_mm_castps_si128(v[q]), expm), lsb));
      if (kStream) {
        _mm_stream_ps(out + i + 4 * q, v[q]);
      } else {
        _mm_store_ps(out + i + 4 * q, v[q]);
      }
      hit[q] = _mm_cmpgt_epi32(_mm_and_si128(_mm_castps_si128(v[q]), absm), lm1);
    }
    if (!_mm_movemask_epi8(_mm_or_si128(_mm_or_si128(hit[0], hit[1]), _mm_or_si128(hit[2], hit[3]))))
      continue;  // no candidate among the 16
    alignas(16) uint32_t vb[16];
    uint32_t mk = 0;
    for (int q = 0; q < 4; ++q) {
      _mm_store_si128(reinterpret_cast<__m128i*>(vb + 4 * q), _mm_castps_si128(v[q]));
      mk |= static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(hit[q]))) << (4 * q);
    }
    while (mk) {
      const int j = __builtin_ctz(mk);
      mk &= mk - 1;
      c.pos.push_back(i + j + shift);
      c.bits.push_back(vb[j]);
    }
  }
  alignas(16) uint32_t lanes[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), badv);
  bad |= lanes[0] | lanes[1] | lanes[2] | lanes[3];
  if (kStream) _mm_sfence();  // the non-temporal stores are visible before any later read of out
#endif
  for (; i < e; ++i) one(i);
  return (bad & E::kSign) == 0;
}

// compensate_collect_f32 for float32; other types never take the fused
// collect (compensate_select_topk passes no FusedCollect for them).
template <typename scalar_t>
bool fused_collect_range(scalar_t*, const scalar_t*, const scalar_t*, int64_t, int64_t,
                         typename Mag<scalar_t>::key_t, int64_t, Cands<Mag<scalar_t>>&, bool) {
  TORCH_INTERNAL_ASSERT(false, "gtopk: fused collect is float32 only");
  return false;
}
template <>
bool fused_collect_range<float>(float* out, const float* g, const float* r, int64_t b, int64_t e,
                                uint32_t L, int64_t shift, Cands<Mag<float>>& c, bool stream) {
  if (stream) {
    return r != nullptr ? compensate_collect_f32<true, true>(out, g, r, b, e, L, shift, c)
                        : compensate_collect_f32<false, true>(out, g, r, b, e, L, shift, c);
  }
  return r != nullptr ? compensate_collect_f32<true, false>(out, g, r, b, e, L, shift, c)
                      : compensate_collect_f32<false, false>(out, g, r, b, e, L, shift, c);
}

inline void prefetch(const void* q) {
#if defined(__GNUC__)
  __builtin_prefetch(q, 0, 0);
#endif
}

// The r-th largest (1-based) of s; s is reordered.
template <typename K>
K kth_largest(std::vector<K>& s, int64_t r) {
  const int64_t m = static_cast<int64_t>(s.size());
  if (r * 8 > m) {
    std::nth_element(s.begin(), s.begin() + (r - 1), s.end(), std::greater<K>());
    return s[r - 1];
  }
  // small r: a min-heap of the r largest so far (most entries fail one compare)
  std::make_heap(s.begin(), s.begin() + r, std::greater<K>());
  for (int64_t i = r; i < m; ++i) {
    if (s[i] > s[0]) {
      std::pop_heap(s.begin(), s.begin() + r, std::greater<K>());
      s[r - 1] = s[i];
      std::push_heap(s.begin(), s.begin() + r, std::greater<K>());
    }
  }
  return s[0];
}

// The r-th largest key (1-based) of a key array: on one thread, or for
// fewer than 2^17 keys, common.h's serial radix select; otherwise MSD radix
// histograms (parallel) narrow the array to the bucket holding it, then
// kth_largest.  keys is consumed.  Digits of 8 bits: a 256-bin histogram
// stays in L1 and costs nothing to clear, and one digit already narrows random keys ~256x
// (16-bit digits cleared and scattered into 768 KB of tables per round);
// narrowed to 4096 keys before nth_element, whose data-dependent
// partitioning mispredicts a branch per comparison on random keys.
template <typename M>
typename M::key_t kth_key(std::vector<typename M::key_t>& keys, int64_t r) {
  using K = typename M::key_t;
  if (at::get_num_threads() <= 1 || at::in_parallel_region() ||
      keys.size() < (size_t(1) << 17))  // one thread: the serial radix select
    return kth_largest_radix(keys.data(), static_cast<int64_t>(keys.size()), r);
  int shift = M::kBits;  // keys agree on every bit from `shift` up
  while (static_cast<int64_t>(keys.size()) > (int64_t(1) << 12) && shift > 0) {
    const int nb = std::min(8, shift), sh = shift - nb;
    const int64_t bins = int64_t(1) << nb;
    const K mask = static_cast<K>(bins - 1);
    const int64_t m = static_cast<int64_t>(keys.size());
    std::vector<int64_t> h(bins, 0);
    std::mutex mu;
    at::parallel_for(0, m, 1 << 15, [&](int64_t b, int64_t e) {
      std::vector<uint32_t> loc(bins, 0);
      for (int64_t i = b; i < e; ++i) ++loc[(keys[i] >> sh) & mask];
      std::lock_guard<std::mutex> g(mu);
      for (int64_t j = 0; j < bins; ++j) h[j] += loc[j];
    });
    int64_t cum = 0, d = bins - 1;
    for (; d > 0; --d) {
      if (cum + h[d] >= r) break;
      cum += h[d];
    }
    r -= cum;
    std::vector<K> next;
    next.reserve(h[d]);
    for (K kk : keys)
      if (static_cast<int64_t>((kk >> sh) & mask) == d) next.push_back(kk);
    keys.swap(next);
    shift = sh;
  }
  return kth_largest(keys, r);
}

// The k-th largest key T and the number of entries equal to T that the top-k
// takes, from candidates holding every entry with key >= T.  Candidates with
// key >= U rank above T; T is the r-th largest of the others.
template <typename M, typename K = typename M::key_t>
std::pair<K, int64_t> resolve(const Cands<M>& c, K U, int64_t r, int64_t k) {
  std::vector<K> mk;
  mk.reserve(c.size());
  for (int64_t j = 0; j < c.size(); ++j) {
    const K kk = c.key(j);
    if (kk < U) mk.push_back(kk);
  }
  TORCH_INTERNAL_ASSERT(r >= 1 && r <= static_cast<int64_t>(mk.size()), "gtopk resolve: rank ", r,
                        " of ", mk.size());
  const K T = kth_key<M>(mk, r);
  int64_t gt = 0;
  for (int64_t j = 0; j < c.size(); ++j) gt += c.key(j) > T;
  return {T, k - gt};
}

// Candidates [j0, j1) with key > T and the first `ties` with key == T, in
// order, written to out[0, n) / vout (n: how many that is).  Branch-free
// (about one candidate in ten is dropped, at random positions): every
// candidate is written, to the next slot while slots are left and to a
// spare once they are not, and the slot advances when it is kept.
template <typename M, typename I, typename K = typename M::key_t>
inline void emit_range(const Cands<M>& c, int64_t j0, int64_t j1, int64_t lo, K T, int64_t ties,
                       int64_t n, I* out, typename M::bits_t* vout) {
  I spare_i;
  typename M::bits_t spare_v;
  int64_t w = 0, left = ties;
  for (int64_t j = j0; j < j1; ++j) {
    const K kk = c.key(j);
    const bool tie = kk == T && left > 0;
    const bool keep = kk > T || tie;
    left -= tie;
    const bool room = w < n;
    *(room ? out + w : &spare_i) = static_cast<I>(lo + c.pos[j]);
    *(room ? vout + w : &spare_v) = c.bits[j];
    w += keep;
  }
}

// Writes lo + position of every candidate with key > T and of the first
// `ties` candidates with key == T (index order), ascending, to out.
template <typename M, typename I, typename K = typename M::key_t>
void emit(const Cands<M>& c, int64_t lo, K T, int64_t ties, I* out,
          typename M::bits_t* vout) {
  const int64_t m = c.size();
  constexpr int64_t B = 1 << 16;
  const int64_t nb = (m + B - 1) / B;
  if (nb <= 1) {
    int64_t gt = 0, eq = 0;
    for (int64_t j = 0; j < m; ++j) {
      const K kk = c.key(j);
      gt += kk > T;
      eq += kk == T;
    }
    emit_range(c, 0, m, lo, T, std::min(eq, ties), gt + std::min(eq, ties), out, vout);
    return;
  }
  std::vector<int64_t> gt(nb, 0), eq(nb, 0), start(nb, 0), take(nb, 0);
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t g = 0, q = 0;
      for (int64_t j = b * B, e = std::min(m, j + B); j < e; ++j) {
        const K kk = c.key(j);
        g += kk > T;
        q += kk == T;
      }
      gt[b] = g;
      eq[b] = q;
    }
  });
  int64_t o = 0, left = ties;
  for (int64_t b = 0; b < nb; ++b) {
    take[b] = std::min(eq[b], left);
    left -= take[b];
    start[b] = o;
    o += gt[b] + take[b];
  }
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      emit_range(c, b * B, std::min(m, (b + 1) * B), lo, T, take[b], gt[b] + take[b],
                 out + start[b], vout + start[b]);
  });
}

template <typename B, typename I>
void fill_all(const B* p, int64_t lo, int64_t n, I* out, B* vout) {
  at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i] = static_cast<I>(lo + i);
    std::copy(p + b, p + e, vout + b);
  });
}

// Small segment: keys in cache, nth_element, one more pass.
template <typename M, typename I>
void topk_small(const typename M::bits_t* p, int64_t lo, int64_t n, int64_t k, I* out,
                typename M::bits_t* vout) {
  using K = typename M::key_t;
  std::vector<K> keys(n);
  for (int64_t i = 0; i < n; ++i) keys[i] = M::key(p[i]);
  std::vector<K> sel(keys);
  const K T = kth_largest(sel, k);
  int64_t gt = 0;
  for (K kk : keys) gt += kk > T;
  const int64_t ties = k - gt;
  int64_t o = 0, taken = 0;
  for (int64_t i = 0; i < n; ++i) {
    const K kk = keys[i];
    if (kk > T || (kk == T && taken++ < ties)) {
      out[o] = static_cast<I>(lo + i);
      vout[o++] = p[i];
    }
  }
}

// A bound L such that count(key >= L) is, with high probability, at least k
// and not much more (k + ~4 sqrt(k) scaled): the R-th largest key of a sample
// of runs of kSampleRun contiguous entries spread evenly over the segment
// (whole cache lines, and at most 64 runs: a sample costs a few dozen
// overlapped cache and TLB misses, not thousands).  `est` estimates count(key >= L).  False when the sample gives
// no useful bound (dense k, heavy ties); a bound that fails (fewer than k
// entries reach it) is detected by the caller.
template <typename M>
bool sample_bound(const typename M::bits_t* p, int64_t n, int64_t k, typename M::key_t& L,
                  int64_t& est, const Producer* produce = nullptr) {
  using K = typename M::key_t;
  const int64_t runs = std::min<int64_t>(kSampleMax, std::max<int64_t>(256, n / 32)) / kSampleRun;
  if (runs * kSampleRun * 4 > n) return false;  // small segment: the histogram is as cheap
  const int64_t step = n / runs;
  const int64_t m = runs * kSampleRun;
  const double q = static_cast<double>(k) * static_cast<double>(m) / static_cast<double>(n);
  const int64_t R = static_cast<int64_t>(std::ceil(q + 4.0 * std::sqrt(q) + 8.0));
  if (R * 16 > m) return false;  // dense k: the histogram bound is cheaper
  // prefetch a few runs ahead: the misses overlap instead of queueing
  constexpr int64_t kAhead = 8;
  for (int64_t r = 0; r < std::min(runs, kAhead); ++r) prefetch(p + r * step);
  std::vector<K> s(m);
  for (int64_t r = 0; r < runs; ++r) {
    if (r + kAhead < runs) prefetch(p + (r + kAhead) * step);
    const typename M::bits_t* q0 = p + r * step;
    if (produce != nullptr) (*produce)(r * step, r * step + kSampleRun);
    for (int64_t j = 0; j < kSampleRun; ++j) s[r * kSampleRun + j] = M::key(q0[j]);
  }
  L = kth_largest(s, R);
  int64_t ge = 0;
  for (K kk : s) ge += kk >= L;
  if (ge > 2 * R + 16) return false;  // heavy ties at L: the candidate set would be large
  est = static_cast<int64_t>(static_cast<double>(ge) * static_cast<double>(n) /
                             static_cast<double>(m)) +
        1;
  return true;
}

// Histogram of digit (key >> sh) & (2^nb - 1) over the entries whose higher
// bits (key >> (sh + nb)) equal `prefix`.
template <typename M>
void histogram(const typename M::bits_t* p, int64_t n, typename M::key_t prefix, int sh, int nb,
               std::vector<int64_t>& h) {
  using K = typename M::key_t;
  const int64_t bins = int64_t(1) << nb;
  const K mask = static_cast<K>(bins - 1);
  const int up = sh + nb;
  h.assign(bins, 0);
  // per-worker uint32 counts (flushed before they could overflow), blocks
  // handed out dynamically
  const int64_t nblk = (n + kBlock - 1) / kBlock;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nblk));
  std::vector<std::vector<uint32_t>> cnt(nt);
  std::vector<int64_t> seen(nt, 0);
  std::mutex mu;
  auto flush = [&](int64_t tid) {
    std::lock_guard<std::mutex> g(mu);
    for (int64_t j = 0; j < bins; ++j) h[j] += cnt[tid][j];
    std::fill(cnt[tid].begin(), cnt[tid].end(), 0u);
    seen[tid] = 0;
  };
  parallel_dynamic(nblk, [&](int64_t tid, int64_t blk) {
    std::vector<uint32_t>& c = cnt[tid];
    if (c.empty()) c.assign(bins, 0u);
    if (seen[tid] > (int64_t(1) << 31)) flush(tid);
    const int64_t s = blk * kBlock, e = std::min(n, s + kBlock);
    for (int64_t i = s; i < e; ++i) {
      const K kk = M::key(p[i]);
      if (static_cast<K>(kk >> up) == prefix) ++c[(kk >> sh) & mask];
    }
    seen[tid] += e - s;
  });
  for (int64_t t = 0; t < nt; ++t)
    if (!cnt[t].empty()) flush(t);
}

template <typename K>
struct Bound {
  K L, U;      // T lies in [L, U)
  int64_t r;   // T is the r-th largest key in [L, U)
  bool exact;     // L == T
};

template <typename M>
Bound<typename M::key_t> hist_bound(const typename M::bits_t* p, int64_t n, int64_t k) {
  using K = typename M::key_t;
  const int64_t limit = std::max<int64_t>(int64_t(1) << 16, k / 4);
  K prefix = 0;
  int64_t r = k;
  int shift = M::kBits;
  // digits of up to 16 bits; fewer for small segments (a histogram much
  // larger than the segment costs more to clear than to fill)
  int width = 8;
  while (width < 16 && (int64_t(1) << (width + 3)) < n) ++width;
  std::vector<int64_t> h;
  while (true) {
    const int nb = std::min(width, shift), sh = shift - nb;
    histogram<M>(p, n, prefix, sh, nb, h);
    int64_t cum = 0, b = (int64_t(1) << nb) - 1;
    for (; b > 0; --b) {
      if (cum + h[b] >= r) break;
      cum += h[b];
    }
    r -= cum;
    prefix = static_cast<K>((static_cast<uint64_t>(prefix) << nb) | static_cast<uint64_t>(b));
    shift = sh;
    if (sh == 0 || h[b] <= limit) {
      Bound<K> B;
      B.L = static_cast<K>(static_cast<uint64_t>(prefix) << sh);
      B.U = static_cast<K>((static_cast<uint64_t>(prefix) + 1) << sh);
      B.r = r;
      B.exact = sh == 0;
      return B;
    }
  }
}

// Exact top-k through the histogram bound (robust for any data).
template <typename M, typename I>
void topk_hist(const typename M::bits_t* p, int64_t lo, int64_t n, int64_t k, I* out,
               typename M::bits_t* vout) {
  using K = typename M::key_t;
  const Bound<K> B = hist_bound<M>(p, n, k);
  Cands<M> c;
  if (B.exact) {
    collect<M, true>(p, n, B.L, B.r, std::numeric_limits<int64_t>::max(), c);
    emit(c, lo, B.L, B.r, out, vout);
  } else {
    collect<M, false>(p, n, B.L, 0, std::numeric_limits<int64_t>::max(), c);
    const auto tr = resolve(c, B.U, B.r, k);
    emit(c, lo, tr.first, tr.second, out, vout);
  }
}

// Exact top-k of one segment: writes min(k, n) ascending global indices.
template <typename M, typename I>
void topk_segment(const typename M::bits_t* p, int64_t lo, int64_t n, int64_t k, I* out,
                  typename M::bits_t* vout, bool try_sample = true) {
  using K = typename M::key_t;
  if (k <= 0 || n == 0) return;
  if (k >= n) {
    fill_all(p, lo, n, out, vout);
    return;
  }
  if (n <= kSmall) {
    topk_small<M>(p, lo, n, k, out, vout);
    return;
  }
  K L;
  int64_t est = 0;
  if (try_sample && sample_bound<M>(p, n, k, L, est)) {
    Cands<M> c;
    const int64_t cap = std::max(4 * est, 4 * k) + 4096;
    if (collect<M, false>(p, n, L, 0, cap, c) && c.size() >= k) {
      const auto tr = resolve(c, std::numeric_limits<K>::max(), k, k);
      emit(c, lo, tr.first, tr.second, out, vout);
      return;
    }
  }
  topk_hist<M>(p, lo, n, k, out, vout);
}

// topk_segment on a buffer that `produce` writes: the sampled bound reads
// only produced runs, the collect pass produces each block just before it
// scans it (one pass over grad and residual, the block still in cache when
// it is scanned); every other path produces the whole segment first.  The
// result is topk_segment's on the produced buffer (it is uniquely defined).
template <typename M, typename I>
void topk_segment_fused(const typename M::bits_t* p, int64_t lo, int64_t n, int64_t k, I* out,
                        typename M::bits_t* vout, const Producer& produce,
                        const FusedCollect<M>* fc = nullptr) {
  using K = typename M::key_t;
  auto produce_all = [&] { at::parallel_for(0, n, kBlock, [&](int64_t b, int64_t e) { produce(b, e); }); };
  if (k <= 0 || n == 0 || k >= n || n <= kSmall) {
    produce_all();
    topk_segment<M>(p, lo, n, k, out, vout);
    return;
  }
  K L;
  int64_t est = 0;
  if (sample_bound<M>(p, n, k, L, est, &produce)) {
    Cands<M> c;
    const int64_t cap = std::max(4 * est, 4 * k) + 4096;
    // room for a block's expected candidates and then some (no regrowth)
    const int64_t reserve = est / std::max<int64_t>(1, n / kBlock) * 5 / 4 + 64;
    if (collect<M, false>(p, n, L, 0, cap, c, &produce, fc, reserve) && c.size() >= k) {
      const auto tr = resolve(c, std::numeric_limits<K>::max(), k, k);
      emit(c, lo, tr.first, tr.second, out, vout);
      return;
    }
    topk_hist<M>(p, lo, n, k, out, vout);  // every block was produced
    return;
  }
  produce_all();
  topk_hist<M>(p, lo, n, k, out, vout);
}

// Threshold selection of one segment, exactly reference._threshold_segment:
// t = the ks-th largest magnitude of a fixed sample (32 runs of 128 entries,
// ks two standard deviations above the expected rank of the k-th magnitude);
// every entry >= t when that count lies within +-10% of k, otherwise the exact
// top-k.  One pass collects the entries >= min(t, L) (L: the exact path's own
// sampled bound), which serves the in-tolerance result and both corrections.
template <typename M, typename I>
struct Selected {
  std::vector<I> idx;
  std::vector<typename M::bits_t> bits;
  void resize(int64_t n) {
    idx.resize(n);
    bits.resize(n);
  }
};

template <typename M, typename I>
void threshold_segment(const typename M::bits_t* p, int64_t lo, int64_t n, int64_t k,
                       Selected<M, I>& out) {
  using K = typename M::key_t;
  if (k >= n) {
    out.resize(n);
    fill_all(p, lo, n, out.idx.data(), out.bits.data());
    return;
  }
  if (k <= 0) return;
  // reference.threshold_sample_positions: everything up to kRefSample
  // entries, else kRefSample / kRefRun runs of kRefRun at r * (n / runs)
  const bool all = n <= kRefSample;
  const int64_t runs = kRefSample / kRefRun;
  const int64_t step = n / runs;
  const int64_t m = all ? n : kRefSample;
  // Python: q = k * m / n (int product, correctly rounded true division);
  // ks = max(1, min(m, ceil(q + THRESHOLD_BIAS * sqrt(q)))) -- the same IEEE
  // operations here, so the same rank.
  const double q = static_cast<double>(k * m) / static_cast<double>(n);
  int64_t ks = static_cast<int64_t>(std::ceil(q + kBias * std::sqrt(q)));
  ks = std::max<int64_t>(1, std::min(m, ks));
  std::vector<K> s(m);
  if (all) {
    for (int64_t j = 0; j < n; ++j) s[j] = M::key(p[j]);
  } else {
    for (int64_t r = 0; r < runs; ++r) prefetch(p + r * step);
    for (int64_t r = 0; r < runs; ++r)
      for (int64_t j = 0; j < kRefRun; ++j) s[r * kRefRun + j] = M::key(p[r * step + j]);
  }
  const K t = kth_largest(s, ks);
  const double lo_tol = (1.0 - kTolerance) * static_cast<double>(k);
  const double hi_tol = (1.0 + kTolerance) * static_cast<double>(k);

  K L = t;
  int64_t est = 0;
  const bool have = sample_bound<M>(p, n, k, L, est);
  const K Lc = have ? std::min(t, L) : t;
  Cands<M> c;
  auto within = [&](int64_t cnt) {
    return lo_tol <= static_cast<double>(cnt) && static_cast<double>(cnt) <= hi_tol;
  };
  auto take_ge_t = [&](int64_t cnt) {  // the candidates >= t (cnt of them)
    out.resize(cnt);
    int64_t o = 0;
    for (int64_t j = 0; j < c.size(); ++j) {
      if (c.key(j) >= t) {
        out.idx[o] = static_cast<I>(lo + c.pos[j]);
        out.bits[o++] = c.bits[j];
      }
    }
  };
  auto exact = [&](bool try_sample) {
    out.resize(k);
    topk_segment<M>(p, lo, n, k, out.idx.data(), out.bits.data(), try_sample);
  };
  if (collect<M, false>(p, n, Lc, 0, std::max(4 * est, 4 * k) + 65536, c)) {
    int64_t ct = 0;
    for (int64_t j = 0; j < c.size(); ++j) ct += c.key(j) >= t;
    if (within(ct)) {
      take_ge_t(ct);
      return;
    }
    if (c.size() >= k) {  // holds every entry >= T: the exact top-k is among them
      const auto tr = resolve(c, std::numeric_limits<K>::max(), k, k);
      out.resize(k);
      emit(c, lo, tr.first, tr.second, out.idx.data(), out.bits.data());
      return;
    }
    exact(!have);  // too few, and the sampled bound failed
    return;
  }
  // Far more than k entries reach Lc.  If Lc == t that is "too many";
  // otherwise count the entries >= t, giving up once past the tolerance.
  if (Lc != t && collect<M, false>(p, n, t, 0, static_cast<int64_t>(std::floor(hi_tol)), c)) {
    if (within(c.size())) {
      take_ge_t(c.size());
      return;
    }
  }
  exact(false);
}

// Runs f(s) for every segment: large segments one after the other (f
// parallelises inside), the others handed out to the threads largest first
// (f runs serially inside the parallel region).
template <typename F>
void for_segments(const int64_t* o, int64_t S, const F& f) {
  const int64_t total = o[S] - o[0];
  const int64_t nt = at::get_num_threads();
  if (nt <= 1 || S <= 1 || total < (int64_t(1) << 16)) {
    for (int64_t s = 0; s < S; ++s) f(s);
    return;
  }
  const int64_t big = std::max<int64_t>(int64_t(1) << 20, total / (2 * nt));
  std::vector<int64_t> small;
  for (int64_t s = 0; s < S; ++s) {
    if (o[s + 1] - o[s] >= big) {
      f(s);
    } else {
      small.push_back(s);
    }
  }
  std::stable_sort(small.begin(), small.end(), [&](int64_t a, int64_t b) {
    return o[a + 1] - o[a] > o[b + 1] - o[b];
  });
  parallel_dynamic(static_cast<int64_t>(small.size()), [&](int64_t, int64_t i) { f(small[i]); });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> select_topk(const at::Tensor& x_, const at::Tensor& offsets,
                                               const at::Tensor& k) {
  check_segments(x_, offsets, k, "select_topk");
  const at::Tensor x = x_.contiguous();
  const int64_t S = k.numel();
  const int64_t* o = offsets.data_ptr<int64_t>();
  const int64_t* ks = k.data_ptr<int64_t>();
  std::vector<int64_t> out_off(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = o[s + 1] - o[s];
    out_off[s + 1] = out_off[s] + std::max<int64_t>(0, std::min(ks[s], n));
  }
  const int64_t total = out_off[S];
  at::Tensor idx = at::empty({total}, x.options().dtype(index_type_for(x.numel())));
  at::Tensor vals = at::empty({total}, x.options());
  GTOPK_DISPATCH_VALUES(x.scalar_type(), "select_topk", [&] {
    using M = Mag<scalar_t>;
    const auto* p = reinterpret_cast<const typename M::bits_t*>(x.data_ptr<scalar_t>());
    auto* v = reinterpret_cast<typename M::bits_t*>(vals.data_ptr<scalar_t>());
    GTOPK_DISPATCH_INDEX(idx.scalar_type(), "select_topk", [&] {
      index_t* out = idx.data_ptr<index_t>();
      for_segments(o, S, [&](int64_t s) {
        topk_segment<M>(p + o[s], o[s], o[s + 1] - o[s], ks[s], out + out_off[s],
                        v + out_off[s]);
      });
    });
  });
  return {idx, vals};
}

std::tuple<at::Tensor, at::Tensor> select_threshold(const at::Tensor& x_,
                                                    const at::Tensor& offsets,
                                                    const at::Tensor& k) {
  check_segments(x_, offsets, k, "select_threshold");
  const at::Tensor x = x_.contiguous();
  const int64_t S = k.numel();
  const int64_t* o = offsets.data_ptr<int64_t>();
  const int64_t* ks = k.data_ptr<int64_t>();
  const auto itype = index_type_for(x.numel());
  at::Tensor idx, vals;
  GTOPK_DISPATCH_VALUES(x.scalar_type(), "select_threshold", [&] {
    using M = Mag<scalar_t>;
    const auto* p = reinterpret_cast<const typename M::bits_t*>(x.data_ptr<scalar_t>());
    GTOPK_DISPATCH_INDEX(itype, "select_threshold", [&] {
      std::vector<Selected<M, index_t>> part(S);
      for_segments(o, S, [&](int64_t s) {
        threshold_segment<M>(p + o[s], o[s], o[s + 1] - o[s], ks[s], part[s]);
      });
      std::vector<int64_t> start(S + 1, 0);
      for (int64_t s = 0; s < S; ++s) start[s + 1] = start[s] + part[s].idx.size();
      idx = at::empty({start[S]}, x.options().dtype(itype));
      vals = at::empty({start[S]}, x.options());
      index_t* out = idx.data_ptr<index_t>();
      auto* v = reinterpret_cast<typename M::bits_t*>(vals.data_ptr<scalar_t>());
      at::parallel_for(0, S, 1, [&](int64_t a, int64_t b) {
        for (int64_t s = a; s < b; ++s) {
          std::copy(part[s].idx.begin(), part[s].idx.end(), out + start[s]);
          std::copy(part[s].bits.begin(), part[s].bits.end(), v + start[s]);
        }
      });
    });
  });
  return {idx, vals};
}

// Fused error-feedback compensation, finiteness check and exact top-k
// (issue #15): acc = grads (concatenated) + residual, written segment by
// segment while the selection's collect pass scans it, so the gradient and
// the residual are read once and the accumulator is read back from cache.
// Returns select_topk(acc, offsets, k) and, per gradient tensor, whether all
// its entries of acc (gradient plus residual) are finite.  float32/float64; grads, residual and acc of one
// dtype (the Python side passes anything else to the reference twin).
std::tuple<at::Tensor, at::Tensor, at::Tensor> compensate_select_topk(
    const at::Tensor& acc, at::TensorList grads, const c10::optional<at::Tensor>& residual,
    const at::Tensor& offsets, const at::Tensor& k) {
  check_segments(acc, offsets, k, "compensate_select_topk");
  TORCH_CHECK(acc.is_contiguous(), "compensate_select_topk: acc must be contiguous");
  TORCH_CHECK(acc.scalar_type() == at::kFloat || acc.scalar_type() == at::kDouble,
              "compensate_select_topk: float32 or float64 only");
  const int64_t T = static_cast<int64_t>(grads.size());
  std::vector<int64_t> tstart(T + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    const at::Tensor& g = grads[t];
    TORCH_CHECK(g.device().is_cpu() && g.is_contiguous() && g.scalar_type() == acc.scalar_type(),
                "compensate_select_topk: gradients must be contiguous CPU tensors of acc's dtype");
    tstart[t + 1] = tstart[t] + g.numel();
  }
  TORCH_CHECK(tstart[T] == acc.numel(), "compensate_select_topk: the gradients hold ", tstart[T],
              " entries, acc ", acc.numel());
  const bool has_r = residual.has_value() && residual->defined();
  if (has_r) {
    TORCH_CHECK(residual->device().is_cpu() && residual->is_contiguous() && residual->dim() == 1 &&
                    residual->numel() == acc.numel() && residual->scalar_type() == acc.scalar_type(),
                "compensate_select_topk: residual must be a contiguous 1-D tensor like acc");
  }
  // acc is written while gradients and residual are still read (the fused
  // collect re-reads them): none may share memory with it
  const char* ab = static_cast<const char*>(acc.data_ptr());
  const char* ae = ab + acc.numel() * acc.element_size();
  auto apart = [&](const at::Tensor& t) {
    const char* tb = static_cast<const char*>(t.data_ptr());
    const char* te = tb + t.numel() * t.element_size();
    return t.numel() == 0 || te <= ab || ae <= tb;
  };
  TORCH_CHECK(!has_r || apart(*residual), "compensate_select_topk: residual overlaps acc");
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(apart(grads[t]), "compensate_select_topk: gradient ", t, " overlaps acc");
  const int64_t S = k.numel();
  const int64_t* o = offsets.data_ptr<int64_t>();
  const int64_t* ks = k.data_ptr<int64_t>();
  TORCH_CHECK(S == 0 || (o[0] == 0 && o[S] == acc.numel()),
              "compensate_select_topk: the segments must cover acc");
  std::vector<int64_t> out_off(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = o[s + 1] - o[s];
    out_off[s + 1] = out_off[s] + std::max<int64_t>(0, std::min(ks[s], n));
  }
  at::Tensor idx = at::empty({out_off[S]}, acc.options().dtype(index_type_for(acc.numel())));
  at::Tensor vals = at::empty({out_off[S]}, acc.options());
  std::unique_ptr<std::atomic<bool>[]> bad(new std::atomic<bool>[std::max<int64_t>(T, 1)]);
  for (int64_t t = 0; t < T; ++t) bad[t].store(false);
  AT_DISPATCH_FLOATING_TYPES(acc.scalar_type(), "compensate_select_topk", [&] {
    using M = Mag<scalar_t>;
    scalar_t* a = acc.data_ptr<scalar_t>();
    const scalar_t* r = has_r ? residual->data_ptr<scalar_t>() : nullptr;
    std::vector<const scalar_t*> gp(T);
    for (int64_t t = 0; t < T; ++t) gp[t] = grads[t].data_ptr<scalar_t>();
    // acc[b, e) (global) = grads + residual, tensor by tensor
    auto produce_global = [&](int64_t b, int64_t e) {
      int64_t t = std::upper_bound(tstart.begin(), tstart.end(), b) - tstart.begin() - 1;
      while (b < e && t < T) {
        const int64_t stop = std::min(e, tstart[t + 1]);
        const int64_t base = tstart[t];
        // pointers shifted so that index i (global) addresses grads[t][i - base]
        if (!compensate_range<scalar_t>(a + base, gp[t], r == nullptr ? nullptr : r + base, b - base,
                                        stop - base))
          bad[t].store(true, std::memory_order_relaxed);
        b = stop;
        ++t;
      }
    };
    const auto* p = reinterpret_cast<const typename M::bits_t*>(a);
    auto* v = reinterpret_cast<typename M::bits_t*>(vals.data_ptr<scalar_t>());
    const bool stream = acc.numel() * acc.element_size() >= kStreamBytes;
    GTOPK_DISPATCH_INDEX(idx.scalar_type(), "compensate_select_topk", [&] {
      index_t* out = idx.data_ptr<index_t>();
      for_segments(o, S, [&](int64_t s) {
        const int64_t lo = o[s];
        const Producer produce = [&, lo](int64_t b, int64_t e) { produce_global(lo + b, lo + e); };
        // float32: the collect pass writes and scans in one loop
        const FusedCollect<M> fc = [&, lo](int64_t b, int64_t e, typename M::key_t L, Cands<M>& c) {
          b += lo;
          e += lo;
          int64_t t = std::upper_bound(tstart.begin(), tstart.end(), b) - tstart.begin() - 1;
          while (b < e && t < T) {
            const int64_t stop = std::min(e, tstart[t + 1]);
            const int64_t base = tstart[t];
            if (!fused_collect_range<scalar_t>(a + base, gp[t], r == nullptr ? nullptr : r + base,
                                               b - base, stop - base, L, base - lo, c, stream))
              bad[t].store(true, std::memory_order_relaxed);
            b = stop;
            ++t;
          }
        };
        topk_segment_fused<M>(p + lo, lo, o[s + 1] - lo, ks[s], out + out_off[s], v + out_off[s],
                              produce, std::is_same<scalar_t, float>::value ? &fc : nullptr);
      });
    });
  });
  at::Tensor finite = at::empty({T}, acc.options().dtype(at::kBool));
  bool* f = finite.data_ptr<bool>();
  for (int64_t t = 0; t < T; ++t) f[t] = !bad[t].load();
  return {idx, vals, finite};
}

}  // namespace cpu
}  // namespace gtopk
