// Segmented exact top-k by radix select: the machinery shared by
// select.cu (dense segments of x) and merge.cu (the union of two sparse sets).
//
// Order.  Every item of a segment has a *composite key*: its magnitude key
// (common.cuh: the bits of |x|, NaN clamped to +inf) followed by
// inv = (segment end - 1 - index).  Larger composite = larger magnitude, then
// smaller index: exactly the tie rule of DESIGN.md §3.  Composite keys are
// unique within a segment (indices are), so the top-k under the tie rule is
// simply "the k largest composite keys", and radix select on the composite
// always ends with a bucket holding exactly the k-th item: no separate tie
// pass, and the result does not depend on the order in which blocks run.
//
// Passes.  The composite is cut into digits of GTOPK_DIGIT (11) bits from the
// top: first the kBits of the magnitude key, then the `wbits` of inv (bits of
// the largest segment length).  Kernel j (j = 0 .. npass, one launch each,
// every segment of the bucket at once) does, for the items of each segment
// still in play:
//   - filter by digit j-1 against the bucket B chosen for it: items above B
//     are selected (written out), items equal to B survive, items below are
//     dropped;
//   - a histogram of digit j of the survivors (per block in shared memory,
//     then added into the segment's global histogram);
//   - the last block of the segment to finish (a ticket counter) picks the
//     bucket of digit j that holds the r-th largest survivor, where r is the
//     rank still to be filled: r -= everything above that bucket.  If the
//     whole bucket is needed (r == its count), kernel j+1 selects it entirely
//     and the segment is done; otherwise the survivors of digit j go on.
// Kernel 0 only histograms.  The composite being unique, the last digit
// always ends with a bucket of one item that is wholly taken, so kernel
// npass finishes every segment.
//
// Candidates.  A segment's items are read from x (all of them, the prefix of
// digits chosen so far checked) until a chosen bucket fits its candidate
// capacity; from then on the survivors are written to a candidate buffer
// (item positions; two buffers, alternating) and later passes read only
// those.  Every kernel checks the whole prefix of every item it reads, so a
// kernel may read any superset of the items in play: x, or a candidate
// buffer.  select.cu can also start a segment from a candidate buffer: the
// entries at or above a sampled lower bound of the k-th key (when they are
// at least k and fit), so x is read once; otherwise, with 11-bit digits, the
// bucket after the first pass holds about k items for typical data and x is
// read twice (histogram, then filter).  Heavy ties (e.g. many zeros) keep a
// segment reading x for a few more passes: slower, equally exact.
//
// Output.  Selected item positions go to the segment's output slots in
// whatever order blocks finish (one atomicAdd per block reserves a range);
// gtopk_plugin/kernels/cuda.py sorts them afterwards (segments occupy
// ascending index ranges, so one global sort orders every segment).
#pragma once

#include "common.cuh"

#define GTOPK_THREADS 256
#define GTOPK_ITEMS 64  // items per thread per block (bits of one u64 mask)
#define GTOPK_CHUNK (GTOPK_THREADS * GTOPK_ITEMS)
#define GTOPK_DIGIT 11
#define GTOPK_BINS 2048  // 2^GTOPK_DIGIT == 8 * GTOPK_THREADS

namespace gtopk {

// Per-segment state: gtopk_i64 st[S * ST_N].
enum {
  ST_R = 0,    // rank still to fill among the items in play
  ST_KP = 1,   // magnitude-key digits chosen so far (key >> shift)
  ST_IP = 2,   // inv digits chosen so far
  ST_B = 3,    // bucket chosen for the latest digit (filtered by the next kernel)
  ST_FIN = 4,  // kernel that takes the whole bucket and finishes; -1: nothing to do
  ST_SRC = 5,  // where this kernel reads its items: 0 x, 1 cand0, 2 cand1
  ST_SRCN = 6, // number of candidates in that buffer
  ST_DST = 7,  // 1: survivors of this kernel's filter go to the candidate buffer
  ST_N = 8
};

// Counters: gtopk_u64 ctr[3 * S]: [0, S) block tickets, [S, 2S) output slots
// used, [2S, 3S) candidate slots used (this kernel).

struct PassSpec {
  int word;  // 0: magnitude key, 1: inv
  int sh;    // digit = (word >> sh) & (2^w - 1)
  int w;
};

__device__ __forceinline__ int num_passes(int kbits, int wbits) {
  return (kbits + GTOPK_DIGIT - 1) / GTOPK_DIGIT + (wbits + GTOPK_DIGIT - 1) / GTOPK_DIGIT;
}

__device__ __forceinline__ PassSpec pass_spec(int p, int kbits, int wbits) {
  const int nk = (kbits + GTOPK_DIGIT - 1) / GTOPK_DIGIT;
  PassSpec ps;
  int top;
  if (p < nk) {
    ps.word = 0;
    top = kbits - GTOPK_DIGIT * p;
  } else {
    ps.word = 1;
    top = wbits - GTOPK_DIGIT * (p - nk);
  }
  ps.w = top < GTOPK_DIGIT ? top : GTOPK_DIGIT;
  ps.sh = top - ps.w;
  return ps;
}

// Items of a dense segment: positions into x.
template <class V>
struct DenseSrc {
  const typename V::bits_t* x;
  __device__ __forceinline__ bool load(gtopk_i64 pos, gtopk_i64 seg_end, gtopk_u64& key,
                                       gtopk_u64& inv) const {
    key = V::key(x[pos]);
    inv = static_cast<gtopk_u64>(seg_end - 1 - pos);
    return true;
  }
};

// Items of a union of sparse sets (merge.cu): positions into the union
// arrays; an item may be a placeholder (a duplicate folded into its twin).
template <class V>
struct UnionSrc {
  const typename V::bits_t* val;
  const gtopk_i64* idx;
  const unsigned char* valid;
  __device__ __forceinline__ bool load(gtopk_i64 pos, gtopk_i64 seg_end, gtopk_u64& key,
                                       gtopk_u64& inv) const {
    if (!valid[pos]) return false;
    key = V::key(val[pos]);
    inv = static_cast<gtopk_u64>(seg_end - 1 - idx[pos]);
    return true;
  }
};

// lay: gtopk_i64[4 * (S + 1)] = item ranges of the segments | block ranges |
// candidate ranges | output slot ranges.  seg_end: the (dense) segment
// boundaries inv is measured from (offsets; the item ranges for x).
template <class V, class Src, typename E>
__device__ __forceinline__ void radix_pass(const Src& src, const gtopk_i64* lay,
                                           const gtopk_i64* seg_end_arr, int S, int j, int kbits,
                                           int wbits, gtopk_i64* st, gtopk_u64* hist,
                                           gtopk_u64* ctr, gtopk_i64* cand0, gtopk_i64* cand1,
                                           E* out) {
  __shared__ gtopk_u32 sh_hist[GTOPK_BINS];
  __shared__ gtopk_u64 sh_scan[32];
  __shared__ gtopk_i64 sh_base[2];
  __shared__ gtopk_i64 sh_sel[3];
  __shared__ int sh_last;

  const gtopk_i64* seg = lay;
  const gtopk_i64* blk = lay + (S + 1);
  const gtopk_i64* cap = lay + 2 * (S + 1);
  const gtopk_i64* outo = lay + 3 * (S + 1);
  const int tid = threadIdx.x;
  const int s = find_range(blk, S, static_cast<gtopk_i64>(blockIdx.x));
  const gtopk_i64 c = static_cast<gtopk_i64>(blockIdx.x) - blk[s];
  gtopk_i64* sts = st + static_cast<gtopk_i64>(s) * ST_N;

  const gtopk_i64 FIN = sts[ST_FIN];
  if (FIN < j) return;  // finished earlier, or nothing to select (uniform per block)
  const bool fin = FIN == j;
  const int npass = num_passes(kbits, wbits);
  if (!fin && j >= npass) return;  // cannot happen: the last digit always finishes

  const gtopk_u64 B = static_cast<gtopk_u64>(sts[ST_B]);
  const gtopk_u64 KP = static_cast<gtopk_u64>(sts[ST_KP]);
  const gtopk_u64 IP = static_cast<gtopk_u64>(sts[ST_IP]);
  const gtopk_i64 SRC = sts[ST_SRC];
  const bool from_cand = SRC != 0;
  const bool to_cand = !fin && j > 0 && sts[ST_DST] != 0;
  const gtopk_i64 lo = seg[s];
  const gtopk_i64 seg_end = seg_end_arr[s + 1];
  const gtopk_i64 nitems = from_cand ? sts[ST_SRCN] : seg[s + 1] - lo;
  const gtopk_i64 cbase = cap[s], ccap = cap[s + 1] - cap[s];
  // survivors go to the buffer this kernel does not read
  const gtopk_i64* cin = SRC == 2 ? cand1 : cand0;
  gtopk_i64* cout = SRC == 1 ? cand1 : cand0;

  PassSpec pp, pc;
  pp.word = pp.sh = pp.w = 0;
  pc = pp;
  if (j > 0) pp = pass_spec(j - 1, kbits, wbits);
  if (!fin) pc = pass_spec(j, kbits, wbits);
  const gtopk_u64 pmask = (1ull << pp.w) - 1ull;
  const gtopk_u64 cmask = (1ull << pc.w) - 1ull;

  if (!fin) {
    for (int b = tid; b < GTOPK_BINS; b += GTOPK_THREADS) sh_hist[b] = 0u;
  }
  __syncthreads();

  // Phase A: classify this thread's items (bit m of the masks: item m).
  gtopk_u64 emask = 0ull, smask = 0ull;
  const gtopk_i64 first = c * GTOPK_CHUNK + tid;
  for (int m = 0; m < GTOPK_ITEMS; ++m) {
    const gtopk_i64 i = first + static_cast<gtopk_i64>(m) * GTOPK_THREADS;
    if (i >= nitems) break;
    const gtopk_i64 pos = from_cand ? cin[cbase + i] : lo + i;
    gtopk_u64 key, inv;
    if (!src.load(pos, seg_end, key, inv)) continue;
    if (j > 0) {
      // still in play: the digits chosen before digit j-1 match
      if (pp.word == 0) {
        if ((key >> (pp.sh + pp.w)) != KP) continue;
      } else {
        if (key != KP || (inv >> (pp.sh + pp.w)) != IP) continue;
      }
      const gtopk_u64 d = ((pp.word ? inv : key) >> pp.sh) & pmask;
      if (d > B || (fin && d == B)) {
        emask |= 1ull << m;
        continue;
      }
      if (d != B) continue;
    }
    if (fin) continue;
    smask |= 1ull << m;
    atomicAdd(&sh_hist[((pc.word ? inv : key) >> pc.sh) & cmask], 1u);
  }

  // Phase B: one range of output (and candidate) slots per block.
  const gtopk_u64 ne = static_cast<gtopk_u64>(__popcll(emask));
  const gtopk_u64 ns = static_cast<gtopk_u64>(__popcll(smask));
  const gtopk_u64 mine = (ne << 32) | ns;
  gtopk_u64 tot;
  const gtopk_u64 excl = block_inclusive_scan(mine, sh_scan, &tot) - mine;
  if (tid == 0) {
    const gtopk_u64 te = tot >> 32, ts = tot & 0xFFFFFFFFull;
    sh_base[0] = te ? static_cast<gtopk_i64>(atomicAdd(&ctr[S + s], te)) : 0;
    sh_base[1] = (to_cand && ts) ? static_cast<gtopk_i64>(atomicAdd(&ctr[2 * S + s], ts)) : 0;
  }
  __syncthreads();

  // Phase C: write the selected positions (and the candidates).
  {
    const gtopk_i64 obase = outo[s], ocap = outo[s + 1] - obase;
    gtopk_i64 e = sh_base[0] + static_cast<gtopk_i64>(excl >> 32);
    for (gtopk_u64 mk = emask; mk; mk &= mk - 1ull) {
      const int m = __ffsll(static_cast<long long>(mk)) - 1;
      const gtopk_i64 i = first + static_cast<gtopk_i64>(m) * GTOPK_THREADS;
      const gtopk_i64 pos = from_cand ? cin[cbase + i] : lo + i;
      if (e < ocap) out[obase + e] = static_cast<E>(pos);
      ++e;
    }
    if (to_cand) {
      gtopk_i64 q = sh_base[1] + static_cast<gtopk_i64>(excl & 0xFFFFFFFFull);
      for (gtopk_u64 mk = smask; mk; mk &= mk - 1ull) {
        const int m = __ffsll(static_cast<long long>(mk)) - 1;
        const gtopk_i64 i = first + static_cast<gtopk_i64>(m) * GTOPK_THREADS;
        const gtopk_i64 pos = from_cand ? cin[cbase + i] : lo + i;
        if (q < ccap) cout[cbase + q] = pos;
        ++q;
      }
    }
  }
  if (fin) return;  // the segment is complete once every block has written

  // Phase D: add the block histogram to the segment's; the last block of the
  // segment chooses the bucket of digit j.
  gtopk_u64* hs_w = hist + static_cast<gtopk_u64>(s) * GTOPK_BINS;
  for (int b = tid; b < GTOPK_BINS; b += GTOPK_THREADS) {
    const gtopk_u32 v = sh_hist[b];
    if (v) atomicAdd(&hs_w[b], static_cast<gtopk_u64>(v));
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const gtopk_u64 t = atomicAdd(&ctr[s], 1ull);
    sh_last = (t + 1ull == static_cast<gtopk_u64>(blk[s + 1] - blk[s])) ? 1 : 0;
  }
  __syncthreads();
  if (!sh_last) return;
  __threadfence();

  // Thread tid owns bins [8g, 8g + 8) with g = 255 - tid, so the inclusive
  // scan in thread order is the suffix sum over bins from the top.
  volatile gtopk_u64* hs = hs_w;
  const int g = GTOPK_THREADS - 1 - tid;
  gtopk_u64 h[8];
  gtopk_u64 part = 0ull;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    h[q] = hs[8 * g + q];
    part += h[q];
  }
#pragma unroll
  for (int q = 0; q < 8; ++q) hs[8 * g + q] = 0ull;  // clean for the next kernel
  gtopk_u64 total;
  const gtopk_u64 suf = block_inclusive_scan(part, sh_scan, &total);  // survivors in bins >= 8g
  gtopk_i64 r = sts[ST_R];
  if (j == 0 && static_cast<gtopk_i64>(total) < r) r = static_cast<gtopk_i64>(total);
  if (tid == 0) sh_sel[0] = -1;
  __syncthreads();
  if (r > 0) {
    const gtopk_u64 ur = static_cast<gtopk_u64>(r);
    const gtopk_u64 suf1 = suf - part;  // survivors in bins >= 8g + 8
    if (suf >= ur && suf1 < ur) {       // exactly one thread
      gtopk_u64 cum = suf1;
      for (int q = 7; q >= 0; --q) {
        if (cum + h[q] >= ur) {
          sh_sel[0] = 8 * g + q;
          sh_sel[1] = static_cast<gtopk_i64>(h[q]);
          sh_sel[2] = static_cast<gtopk_i64>(ur - cum);
          break;
        }
        cum += h[q];
      }
    }
  }
  __syncthreads();
  if (tid == 0) {
    if (r <= 0 || sh_sel[0] < 0) {
      sts[ST_FIN] = -1;  // nothing (left) to select
    } else {
      if (j > 0) {  // digit j-1 is now part of the prefix
        if (pp.word == 0) {
          sts[ST_KP] = static_cast<gtopk_i64>((KP << pp.w) | B);
        } else {
          sts[ST_IP] = static_cast<gtopk_i64>((IP << pp.w) | B);
        }
      }
      if (to_cand) {  // the next kernel reads this kernel's survivors
        sts[ST_SRC] = SRC == 1 ? 2 : 1;
        sts[ST_SRCN] = static_cast<gtopk_i64>(total);
      }  // else it reads the same items again (the prefix check skips those out of play)
      const gtopk_i64 hb = sh_sel[1], rem = sh_sel[2];
      sts[ST_B] = sh_sel[0];
      sts[ST_R] = rem;
      if (rem == hb) {
        sts[ST_FIN] = j + 1;  // the whole bucket: kernel j+1 takes it and finishes
      } else {
        sts[ST_DST] = hb <= ccap ? 1 : 0;
      }
    }
    ctr[s] = 0ull;
    ctr[2 * S + s] = 0ull;
  }
}

}  // namespace gtopk

// Segment state at the start: r = min(k, n), nothing chosen, items read from
// x.  Segments with nothing to select are finished (-1) from the start.
extern "C" __global__ void gtopk_radix_init(const gtopk_i64* seg, const gtopk_i64* k, int S,
                                            gtopk_i64* st) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= S) return;
  const gtopk_i64 n = seg[s + 1] - seg[s];
  const gtopk_i64 r = k[s] < n ? k[s] : n;
  gtopk_i64* p = st + static_cast<gtopk_i64>(s) * gtopk::ST_N;
  p[gtopk::ST_R] = r > 0 ? r : 0;
  p[gtopk::ST_KP] = 0;
  p[gtopk::ST_IP] = 0;
  p[gtopk::ST_B] = 0;
  p[gtopk::ST_FIN] = r > 0 ? GTOPK_I64_MAX : -1;
  p[gtopk::ST_SRC] = 0;
  p[gtopk::ST_SRCN] = 0;
  p[gtopk::ST_DST] = 0;
}
