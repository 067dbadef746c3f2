// The CPU executor's runtime: runs a kernel launch block after block, the
// threads of a block as fibers, and checks what a GPU sanitizer would.
//
// Fibers: glibc ucontext (makecontext starts each fiber once; switches are
// _setjmp/_longjmp, which skip the signal-mask system call of swapcontext).
// A fiber runs until it waits (barrier, warp collective), exits, or -- in
// the random schedule -- is preempted at an instrumented memory access.
//
// Checks (reports are collected, see cuda_exec_report):
//   - races: every shared and global access (the compiler's -fsanitize=thread
//     instrumentation calls the __tsan_* hooks below) is recorded per 4-byte
//     granule with who made it, in which barrier interval and warp interval,
//     and after how many fences; two accesses by different threads with at
//     least one plain write are a race unless ordered: same block and a
//     __syncthreads between, same warp and a warp collective between, or
//     other blocks whose accesses were fenced and published by an atomic
//     this thread's block acquired (fence; atomic ... atomic; fence);
//   - shared memory is poisoned (0xFF) at block start and a read of a byte
//     not yet written by the block is reported; each rewritten __shared__
//     declaration is followed by a redzone;
//   - global accesses must fall in a registered tensor (fatal otherwise: the
//     launch is abandoned before the access happens), and be aligned;
//   - __syncthreads must be reached by every thread of the block, at the
//     same call site; warp collectives must name the calling lane in their
//     mask and be met by every lane the mask names;
//   - deadlocks and launches over their time limit are abandoned.
#undef _FORTIFY_SOURCE
#include <dlfcn.h>
#include <setjmp.h>
#include <sys/mman.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "../include/cuda_executor.h"

#undef threadIdx
#undef blockIdx
#undef blockDim
#undef gridDim

namespace {

// ---------------------------------------------------------------------------
// Reports

enum Kind {
  R_RACE_RAW = 1,     // read after an unordered write
  R_RACE_WAW = 2,     // write after an unordered write
  R_RACE_WAR = 3,     // write after an unordered read
  R_UNINIT = 4,       // shared memory read before the block wrote it
  R_OOB = 5,          // global access outside every registered tensor (fatal)
  R_REDZONE = 6,      // shared access past the end of a __shared__ variable
  R_MISALIGNED = 7,   // access not aligned to its size (fatal)
  R_BAR_EXIT = 8,     // threads exited while others wait at __syncthreads
  R_BAR_SITE = 9,     // threads wait at different __syncthreads
  R_WARP_MASK = 10,   // a lane calls a warp collective with a mask without itself
  R_WARP_MISMATCH = 11,  // lanes of one mask call different collectives
  R_WARP_SRC = 12,    // a shuffle reads a lane outside the mask
  R_DEADLOCK = 13,    // nobody can run (fatal)
  R_TIMEOUT = 14,     // the launch ran over its time limit (fatal)
};

struct Report {  // mirrored by cuda_executor/_runtime.py
  int32_t kind;
  int32_t space;  // 0 global, 1 shared
  uint64_t addr;
  uint32_t size;
  uint32_t block;
  uint32_t tid;
  uint32_t pc;  // offset in the module
  uint32_t pblock;
  uint32_t ptid;
  uint32_t ppc;
  uint32_t pkind;  // previous access: 1 read, 2 write, 6 atomic
  uint32_t count;  // occurrences (same kind and sites)
  char text[160];
};

// ---------------------------------------------------------------------------
// Shadow memory: one cell per 4-byte granule.

enum { A_READ = 1, A_WRITE = 2, A_ATOMIC = 4 };

struct Rec {
  uint32_t gen;     // launch (global) or block (shared) generation; stale: no access
  uint32_t block;   // linear block index
  uint32_t epoch;   // the block's barrier interval
  uint32_t wepoch;  // the warp's collective interval
  uint32_t pc;
  uint16_t tid;
  uint16_t fence;   // fences the thread had executed before this access
  uint8_t mask;     // bytes of the granule
  uint8_t kind;
};

struct Cell {
  Rec w;   // the last write
  Rec w2;  // an earlier atomic write not ordered before w (atomics do not order each other)
  Rec r;   // a read
  uint32_t igen;  // shared: bytes written by the block (imask) in generation igen
  uint8_t imask;
};

struct Storage {
  uintptr_t lo, hi;
  Cell* shadow;
};

// A block's published fence counts: fc[t] = fences thread t had executed
// before the point this snapshot describes.
struct Snap {
  uint32_t block;
  std::vector<uint16_t> fc;
};
typedef std::shared_ptr<const Snap> SnapP;
typedef std::vector<SnapP> SyncList;  // at most one snapshot per block

void join_into(SyncList& a, const SyncList& b) {
  for (const SnapP& s : b) {
    bool found = false;
    for (SnapP& x : a) {
      if (x->block != s->block) continue;
      found = true;
      if (x == s) break;
      bool more = false, less = false;
      for (size_t i = 0; i < s->fc.size(); ++i) {
        if (s->fc[i] > x->fc[i]) more = true;
        if (s->fc[i] < x->fc[i]) less = true;
      }
      if (!more) break;
      if (!less) {
        x = s;
        break;
      }
      auto m = std::make_shared<Snap>(*x);
      for (size_t i = 0; i < s->fc.size(); ++i) m->fc[i] = std::max(m->fc[i], s->fc[i]);
      x = m;
      break;
    }
    if (!found) a.push_back(s);
  }
}

// ---------------------------------------------------------------------------
// Threads and fibers

enum State : uint8_t { READY, WAIT_BAR, WAIT_WARP, EXITED };

struct Fiber {
  jmp_buf jb;
  ucontext_t uc;
  char* stack;
  bool fresh;
};

struct Thr {
  uint32_t tid;
  State st;
  uint16_t fc;
  void* bar_pc;
  int bar_line;
  int bar_kind;  // 0 plain, 1 or, 2 and, 3 count
  int bar_pred;
  SyncList acq;       // what this thread has acquired (after its fence)
  SyncList pending;   // observed by an atomic of its block, not yet fenced
};

struct Warp {
  uint32_t arrived, mask;
  int op, width, line;
  void* pc;
  uint32_t gen;
  uint64_t val[32];
  uint64_t res[2][32];
  int arg[32];
};

const size_t kStack = 256 * 1024;
const int kMaxThreads = 1024;

// launch state
Fiber fibers[kMaxThreads];
Thr thr[kMaxThreads];
Warp warps[kMaxThreads / 32];
uint32_t wepoch[kMaxThreads / 32];
char* stack_base = nullptr;
size_t stack_span = 0;
jmp_buf sched_jb;
Thr* cur = nullptr;

const cuda_exec::Entry* k_entry = nullptr;
void** k_args = nullptr;
uintptr_t mod_base = 0;
dim3 grid_dim, block_dim;
uint3 block_idx;
uint32_t nthreads = 0, cur_block = 0;
uint32_t launch_gen = 0, block_gen = 0, epoch = 0;
int policy = 0;  // 0 forward, 1 reverse, 2 random
uint64_t rng_state = 1;
int preempt = 0;  // mean accesses between preemptions (random schedule; 0: none)
int preempt_left = 0;
bool aborted = false;
uint64_t accesses = 0;
double deadline = 0;
int bar_result = 0;
bool snap_dirty = true;
SnapP block_snap;
uint64_t ready_bits[kMaxThreads / 64];

// memory
std::vector<Storage> storages;  // sorted, disjoint
std::vector<std::pair<uintptr_t, uintptr_t>> views, merged;  // registered tensors
bool views_dirty = false;
size_t last_view = 0, last_storage = 0;

// A __shared__ variable: [lo, vend) then its redzone [vend, hi).
struct Box {
  uintptr_t lo, vend, hi;
  std::vector<Cell> shadow;
};
std::unordered_map<const void*, std::vector<Box>> boxes_by_module;  // sorted by lo
std::vector<Box>* boxes = nullptr;
uintptr_t boxes_lo = 0, boxes_hi = 0;
const void* cur_module = nullptr;
std::vector<char> dyn;
Box dyn_box;  // the launch's dynamic shared memory
char* dyn_lo = nullptr;
size_t dyn_size = 0;
std::unordered_map<uintptr_t, SyncList> sync_vars;

// reports
std::vector<Report> reports;
std::unordered_map<std::string, size_t> report_index;
uint32_t total_reports = 0;

double now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

uint64_t rnd() {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

uint32_t pc_off(void* pc) {
  return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(pc) - mod_base);
}

void report(int kind, int space, uintptr_t addr, uint32_t size, uint32_t pc, const Rec* prev,
            const char* text) {
  ++total_reports;
  char key[96];
  snprintf(key, sizeof key, "%d:%u:%u", kind, pc, prev ? prev->pc : 0u);
  auto it = report_index.find(key);
  if (it != report_index.end()) {
    ++reports[it->second].count;
    return;
  }
  if (reports.size() >= 200) return;
  Report r;
  memset(&r, 0, sizeof r);
  r.kind = kind;
  r.space = space;
  r.addr = addr;
  r.size = size;
  r.block = cur_block;
  r.tid = cur ? cur->tid : 0xFFFFFFFFu;
  r.pc = pc;
  if (prev) {
    r.pblock = prev->block;
    r.ptid = prev->tid;
    r.ppc = prev->pc;
    r.pkind = prev->kind;
  }
  r.count = 1;
  snprintf(r.text, sizeof r.text, "%s", text ? text : "");
  report_index[key] = reports.size();
  reports.push_back(r);
}

// ---------------------------------------------------------------------------
// Scheduling

inline void set_ready(uint32_t t) {
  thr[t].st = READY;
  ready_bits[t >> 6] |= 1ull << (t & 63);
}
inline void clear_ready(uint32_t t) { ready_bits[t >> 6] &= ~(1ull << (t & 63)); }

int pick() {
  const uint32_t nw = (nthreads + 63) / 64;
  if (policy == 0) {
    for (uint32_t i = 0; i < nw; ++i)
      if (ready_bits[i]) return static_cast<int>(i * 64 + __builtin_ctzll(ready_bits[i]));
  } else if (policy == 1) {
    for (uint32_t i = nw; i-- > 0;)
      if (ready_bits[i]) return static_cast<int>(i * 64 + 63 - __builtin_clzll(ready_bits[i]));
  } else {
    uint32_t n = 0;
    for (uint32_t i = 0; i < nw; ++i) n += __builtin_popcountll(ready_bits[i]);
    if (!n) return -1;
    uint32_t k = static_cast<uint32_t>(rnd() % n);
    for (uint32_t i = 0; i < nw; ++i) {
      uint64_t b = ready_bits[i];
      const uint32_t c = __builtin_popcountll(b);
      if (k >= c) {
        k -= c;
        continue;
      }
      while (k--) b &= b - 1;
      return static_cast<int>(i * 64 + __builtin_ctzll(b));
    }
  }
  return -1;
}

// Back to the scheduler (the caller has set its state).
inline void to_sched() {
  Fiber& f = fibers[cur->tid];
  if (!_setjmp(f.jb)) _longjmp(sched_jb, 1);
}

[[noreturn]] void abort_launch() {
  aborted = true;
  _longjmp(sched_jb, 1);
}

void fiber_main(int idx) {
  for (;;) {
    k_entry->invoke(k_entry->fn, k_args);
    thr[idx].st = EXITED;
    to_sched();
  }
}

void resume(int t) {
  cur = &thr[t];
  clear_ready(static_cast<uint32_t>(t));
  Fiber& f = fibers[t];
  if (!_setjmp(sched_jb)) {
    if (f.fresh) {
      f.fresh = false;
      setcontext(&f.uc);
    }
    _longjmp(f.jb, 1);
  }
  cur = nullptr;
}

void make_fibers(uint32_t n) {
  if (!stack_base) {
    stack_span = kStack * kMaxThreads;
    void* p = mmap(nullptr, stack_span, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      perror("cuda_executor: mmap of the fiber stacks");
      abort();
    }
    stack_base = static_cast<char*>(p);
    for (int i = 0; i < kMaxThreads; ++i) {
      fibers[i].stack = stack_base + i * kStack;
      mprotect(fibers[i].stack, 4096, PROT_NONE);  // guard page
      fibers[i].fresh = true;
      fibers[i].uc.uc_stack.ss_sp = nullptr;
    }
  }
  for (uint32_t i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    if (!f.fresh || f.uc.uc_stack.ss_sp) continue;
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = f.stack + 4096;
    f.uc.uc_stack.ss_size = kStack - 4096;
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, reinterpret_cast<void (*)()>(fiber_main), 1, static_cast<int>(i));
  }
}

void reset_fibers() {  // after an abandoned launch: fibers restart from scratch
  for (int i = 0; i < kMaxThreads; ++i) {
    fibers[i].fresh = true;
    fibers[i].uc.uc_stack.ss_sp = nullptr;
  }
}

// ---------------------------------------------------------------------------
// Happens-before

SnapP my_snap(const Thr& me) {
  if (snap_dirty || !block_snap) {
    auto s = std::make_shared<Snap>();
    s->block = cur_block;
    s->fc.resize(nthreads);
    for (uint32_t i = 0; i < nthreads; ++i) s->fc[i] = block_snap ? block_snap->fc[i] : 0;
    block_snap = s;
    snap_dirty = false;
  }
  if (block_snap->fc[me.tid] == me.fc) return block_snap;
  auto s = std::make_shared<Snap>(*block_snap);
  s->fc[me.tid] = me.fc;
  return s;
}

// Is the earlier access `a` ordered before the running thread's access?
inline bool ordered(const Rec& a) {
  const Thr& me = *cur;
  if (a.block == cur_block) {
    if (a.tid == me.tid) return true;
    if (a.epoch != epoch) return true;
    return (a.tid >> 5) == (me.tid >> 5) && a.wepoch != wepoch[me.tid >> 5];
  }
  // another block: ordered if that thread fenced after the access and a
  // release published the fence to what this thread acquired; an atomic
  // made after a fence is itself a release (fence; atomic), published with it
  for (const SnapP& s : me.acq) {
    if (s->block != a.block) continue;
    if (a.tid >= s->fc.size()) return false;
    const uint16_t p = s->fc[a.tid];
    return p > a.fence || ((a.kind & A_ATOMIC) && a.fence > 0 && p == a.fence);
  }
  return false;
}

inline void fill(Rec& r, uint32_t gen, uint32_t pc, uint8_t mask, uint8_t kind) {
  const Thr& me = *cur;
  r.gen = gen;
  r.block = cur_block;
  r.epoch = epoch;
  r.wepoch = wepoch[me.tid >> 5];
  r.pc = pc;
  r.tid = static_cast<uint16_t>(me.tid);
  r.fence = me.fc;
  r.mask = mask;
  r.kind = kind;
}

void cell_access(Cell& c, uint32_t gen, int space, uintptr_t addr, uint32_t size, uint8_t mask,
                 uint8_t kind, uint32_t pc) {
  const bool write = kind & A_WRITE, atomic = kind & A_ATOMIC;
  if (space == 1 && (kind & A_READ) && (c.igen != gen || (c.imask & mask) != mask))
    report(R_UNINIT, space, addr, size, pc, nullptr, "read of shared memory the block never wrote");
  if (c.w.gen == gen && (c.w.mask & mask) && !(atomic && (c.w.kind & A_ATOMIC)) && !ordered(c.w))
    report(write ? R_RACE_WAW : R_RACE_RAW, space, addr, size, pc, &c.w, nullptr);
  else if (!atomic && c.w2.gen == gen && (c.w2.mask & mask) && !ordered(c.w2))
    report(write ? R_RACE_WAW : R_RACE_RAW, space, addr, size, pc, &c.w2, nullptr);
  if (write && c.r.gen == gen && (c.r.mask & mask) && !(atomic && (c.r.kind & A_ATOMIC)) &&
      !ordered(c.r))
    report(R_RACE_WAR, space, addr, size, pc, &c.r, nullptr);
  if (write) {
    if (!atomic) {
      c.w2.gen = 0;  // checked against both: every earlier write is settled
    } else if (c.w.gen == gen && (c.w.kind & A_ATOMIC)) {
      // keep another block's atomic if there is one (it is the one a later
      // plain access of this block may be unordered with)
      if (c.w.block != cur_block ||
          (c.w.tid != cur->tid && !(c.w2.gen == gen && c.w2.block != cur_block)))
        c.w2 = c.w;
    }
    fill(c.w, gen, pc, mask, kind);
    if (space == 1) {
      if (c.igen != gen) {
        c.igen = gen;
        c.imask = 0;
      }
      c.imask |= mask;
    }
  } else if (c.r.gen != gen || ordered(c.r) || !(c.r.mask & mask)) {
    fill(c.r, gen, pc, mask, kind);
  }
}

void rebuild_views() {
  merged = views;
  std::sort(merged.begin(), merged.end());
  size_t o = 0;
  for (size_t i = 0; i < merged.size(); ++i) {
    if (o && merged[i].first <= merged[o - 1].second) {
      merged[o - 1].second = std::max(merged[o - 1].second, merged[i].second);
    } else {
      merged[o++] = merged[i];
    }
  }
  merged.resize(o);
  views_dirty = false;
  last_view = 0;
}

bool in_views(uintptr_t p, uintptr_t e) {
  if (last_view < merged.size() && merged[last_view].first <= p && e <= merged[last_view].second)
    return true;
  size_t lo = 0, hi = merged.size();
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (merged[mid].second <= p) lo = mid + 1; else hi = mid;
  }
  if (lo < merged.size() && merged[lo].first <= p && e <= merged[lo].second) {
    last_view = lo;
    return true;
  }
  return false;
}

Storage* find_storage(uintptr_t p) {
  if (last_storage < storages.size() && storages[last_storage].lo <= p &&
      p < storages[last_storage].hi)
    return &storages[last_storage];
  size_t lo = 0, hi = storages.size();
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (storages[mid].hi <= p) lo = mid + 1; else hi = mid;
  }
  if (lo < storages.size() && storages[lo].lo <= p && p < storages[lo].hi) {
    last_storage = lo;
    return &storages[lo];
  }
  return nullptr;
}

Box* find_box(uintptr_t p) {
  if (dyn_size && p >= dyn_box.lo && p < dyn_box.hi) return &dyn_box;
  if (p < boxes_lo || p >= boxes_hi) return nullptr;
  std::vector<Box>& v = *boxes;
  size_t lo = 0, hi = v.size();
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (v[mid].hi <= p) lo = mid + 1; else hi = mid;
  }
  return lo < v.size() && v[lo].lo <= p ? &v[lo] : nullptr;
}

void use_module(const void* mod) {
  cur_module = mod;
  boxes = &boxes_by_module[mod];
  boxes_lo = boxes->empty() ? 0 : boxes->front().lo;
  boxes_hi = boxes->empty() ? 0 : boxes->back().hi;
}

void maybe_preempt() {
  if (++accesses % (1u << 18) == 0 && now() > deadline) {
    report(R_TIMEOUT, 0, 0, 0, 0, nullptr, "the launch ran over its time limit");
    abort_launch();
  }
  if (preempt && --preempt_left <= 0) {
    preempt_left = 1 + static_cast<int>(rnd() % (2 * preempt));
    set_ready(cur->tid);
    to_sched();
  }
}

void access(void* a, uint32_t size, uint8_t kind, void* pcp) {
  if (!cur) return;
  const uintptr_t p = reinterpret_cast<uintptr_t>(a);
  if (p - reinterpret_cast<uintptr_t>(stack_base) < stack_span) return;  // a thread's locals
  const uint32_t pc = pc_off(pcp);
  const uintptr_t e = p + size;
  if ((size & (size - 1)) == 0 && (p & ((size < 8 ? size : 8) - 1))) {
    report(R_MISALIGNED, 0, p, size, pc, nullptr, "misaligned access");
    abort_launch();
  }
  int space;
  uintptr_t base;
  Cell* cells;
  Box* bx = find_box(p);
  if (bx) {
    if (e > bx->vend) {
      report(R_REDZONE, 1, p, size, pc, nullptr,
             bx == &dyn_box ? "access past the end of the dynamic shared memory"
                            : "access past the end of a __shared__ variable");
      return;  // the redzone is the executor's: nothing to record
    }
    space = 1;
    base = bx->lo;
    cells = bx->shadow.data();
  } else {
    if (!in_views(p, e)) {
      report(R_OOB, 0, p, size, pc, nullptr,
             "global access outside every tensor passed to the launch");
      abort_launch();
    }
    Storage* s = find_storage(p);
    if (!s) return;  // registered view without storage: cannot happen
    if (!s->shadow) {
      s->shadow = static_cast<Cell*>(calloc((s->hi - s->lo + 3) / 4 + 2, sizeof(Cell)));
      if (!s->shadow) abort();
    }
    space = 0;
    base = s->lo;
    cells = s->shadow;
  }
  const uint32_t gen = space ? block_gen : launch_gen;
  for (uintptr_t q = p & ~uintptr_t(3); q < e; q += 4) {
    uint8_t mask = 0xF;
    if (q < p) mask &= static_cast<uint8_t>(0xF << (p - q));
    if (q + 4 > e) mask &= static_cast<uint8_t>(0xF >> (q + 4 - e));
    cell_access(cells[(q - base) >> 2], gen, space, p, size, mask, kind, pc);
  }
  if (!(kind & A_ATOMIC)) maybe_preempt();
}

// ---------------------------------------------------------------------------
// Barriers and warps

void wait_barrier(int kind, int pred, void* pc, int line) {
  Thr& me = *cur;
  me.st = WAIT_BAR;
  me.bar_line = line;
  me.bar_kind = kind;
  me.bar_pred = pred;
  me.bar_pc = pc;
  to_sched();
}

// Every live thread waits at a barrier: check it, release it.
void release_barrier() {
  uint32_t live = 0, exited = 0;
  Thr* first = nullptr;
  bool site_mismatch = false;
  int acc_or = 0, acc_and = 1, acc_count = 0;
  for (uint32_t t = 0; t < nthreads; ++t) {
    Thr& x = thr[t];
    if (x.st == EXITED) {
      ++exited;
      continue;
    }
    ++live;
    if (!first) first = &x;
    else if (x.bar_line != first->bar_line || x.bar_kind != first->bar_kind) site_mismatch = true;
    acc_or |= x.bar_pred != 0;
    acc_and &= x.bar_pred != 0;
    acc_count += x.bar_pred != 0;
  }
  if (exited) {
    char text[160];
    snprintf(text, sizeof text, "%u of %u threads exited while the others wait at __syncthreads",
             exited, nthreads);
    Thr* keep = cur;
    cur = first;
    report(R_BAR_EXIT, 0, 0, 0, pc_off(first->bar_pc), nullptr, text);
    cur = keep;
  }
  if (site_mismatch) {
    Thr* other = nullptr;
    for (uint32_t t = 0; t < nthreads; ++t)
      if (thr[t].st == WAIT_BAR && thr[t].bar_line != first->bar_line) other = &thr[t];
    Rec r;
    memset(&r, 0, sizeof r);
    if (other) {
      r.block = cur_block;
      r.tid = static_cast<uint16_t>(other->tid);
      r.pc = pc_off(other->bar_pc);
    }
    Thr* keep = cur;
    cur = first;
    report(R_BAR_SITE, 0, 0, 0, pc_off(first->bar_pc), other ? &r : nullptr,
           "threads of one block wait at different __syncthreads");
    cur = keep;
  }
  const int kind = first->bar_kind;
  bar_result = kind == 1 ? acc_or : kind == 2 ? acc_and : kind == 3 ? acc_count : 0;
  // happens-before: what any thread acquired reaches all of them; fences
  // executed before the barrier are published by any later atomic
  SyncList acq, pending;
  bool fc_changed = !block_snap;
  for (uint32_t t = 0; t < nthreads; ++t) {
    Thr& x = thr[t];
    if (x.st == EXITED) continue;
    join_into(acq, x.acq);
    join_into(pending, x.pending);
    if (block_snap && block_snap->fc[t] != x.fc) fc_changed = true;
  }
  if (fc_changed) {
    auto s = std::make_shared<Snap>();
    s->block = cur_block;
    s->fc.resize(nthreads);
    for (uint32_t t = 0; t < nthreads; ++t) s->fc[t] = thr[t].fc;
    block_snap = s;
    snap_dirty = false;
  }
  ++epoch;
  for (uint32_t t = 0; t < nthreads; ++t) {
    Thr& x = thr[t];
    if (x.st == EXITED) continue;
    x.acq = acq;
    x.pending = pending;
    set_ready(t);
  }
}

const char* warp_op_name(int op) {
  static const char* names[] = {"__syncwarp", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                "__shfl_xor_sync", "__ballot_sync", "__any_sync", "__all_sync"};
  return op >= 0 && op < 8 ? names[op] : "?";
}

void complete_warp(Warp& w, uint32_t wi) {
  const uint32_t buf = w.gen & 1;
  const int width = w.width;
  uint32_t vote = 0;
  for (int l = 0; l < 32; ++l)
    if ((w.mask >> l & 1) && w.val[l]) vote |= 1u << l;
  for (int l = 0; l < 32; ++l) {
    if (!(w.mask >> l & 1)) continue;
    int src = l;
    const int seg = l & ~(width - 1);
    switch (w.op) {
      case cuda_exec_detail::W_IDX: src = seg + (w.arg[l] & (width - 1)); break;
      case cuda_exec_detail::W_UP: src = (l - seg) >= w.arg[l] ? l - w.arg[l] : l; break;
      case cuda_exec_detail::W_DOWN: src = (l - seg) + w.arg[l] < width ? l + w.arg[l] : l; break;
      case cuda_exec_detail::W_XOR: src = l ^ w.arg[l]; if (src >= seg + width) src = l; break;
      default: break;
    }
    uint64_t r = 0;
    switch (w.op) {
      case cuda_exec_detail::W_BALLOT: r = vote; break;
      case cuda_exec_detail::W_ANY: r = vote != 0; break;
      case cuda_exec_detail::W_ALL: r = vote == w.mask; break;
      case cuda_exec_detail::W_SYNC: r = 0; break;
      default:
        if (src < 0 || src > 31 || !(w.mask >> src & 1)) {
          Thr* keep = cur;
          cur = &thr[wi * 32 + l];
          report(R_WARP_SRC, 0, 0, 0, pc_off(w.pc), nullptr,
                 "a shuffle reads a lane that is not in its mask (undefined value)");
          cur = keep;
          r = 0xFFFFFFFFFFFFFFFFull;
        } else {
          r = w.val[src];
        }
    }
    w.res[buf][l] = r;
  }
  ++w.gen;
  ++wepoch[wi];
  w.arrived = 0;
  for (int l = 0; l < 32; ++l) {
    const uint32_t t = wi * 32 + l;
    if ((w.mask >> l & 1) && t < nthreads && thr[t].st == WAIT_WARP) set_ready(t);
  }
}

uint64_t warp_op(int op, unsigned mask, uint64_t v, int arg, int width, void* pc, int line) {
  Thr& me = *cur;
  const uint32_t lane = me.tid & 31, wi = me.tid >> 5;
  const uint32_t lanes = nthreads - wi * 32 >= 32 ? 0xFFFFFFFFu : (1u << (nthreads - wi * 32)) - 1u;
  if (!(mask >> lane & 1)) {
    report(R_WARP_MASK, 0, 0, 0, pc_off(pc), nullptr,
           "a lane calls a warp collective whose mask does not name it");
    mask |= 1u << lane;
  }
  if (mask & ~lanes) {
    report(R_WARP_MASK, 0, 0, 0, pc_off(pc), nullptr,
           "a warp collective's mask names lanes beyond the block");
    mask &= lanes;
  }
  if (width < 1 || width > 32 || (width & (width - 1))) width = 32;
  Warp& w = warps[wi];
  if (w.arrived == 0) {
    w.mask = mask;
    w.op = op;
    w.width = width;
    w.pc = pc;
    w.line = line;
  } else if (w.mask != mask || w.op != op || (op != cuda_exec_detail::W_SYNC && w.line != line)) {
    char text[160];
    snprintf(text, sizeof text, "lanes of warp %u meet at different collectives (%s mask %08x, %s mask %08x)",
             wi, warp_op_name(w.op), w.mask, warp_op_name(op), mask);
    report(R_WARP_MISMATCH, 0, 0, 0, pc_off(pc), nullptr, text);
    w.mask |= mask;
  }
  w.val[lane] = v;
  w.arg[lane] = arg;
  w.arrived |= 1u << lane;
  const uint32_t buf = w.gen & 1;
  if ((w.arrived & w.mask) == w.mask) {
    complete_warp(w, wi);
    if (policy == 2) {  // let the other lanes go first, sometimes
      if (rnd() & 1) {
        set_ready(me.tid);
        to_sched();
      }
    }
    return w.res[buf][lane];
  }
  me.st = WAIT_WARP;
  to_sched();
  return w.res[buf][lane];
}

// ---------------------------------------------------------------------------
// One block

void run_block(uint32_t b) {
  cur_block = b;
  block_idx.x = b % grid_dim.x;
  block_idx.y = (b / grid_dim.x) % grid_dim.y;
  block_idx.z = b / (grid_dim.x * grid_dim.y);
  ++block_gen;
  epoch = 1;
  block_snap.reset();
  snap_dirty = true;
  for (Box& bx : *boxes) memset(reinterpret_cast<void*>(bx.lo), 0xFF, bx.vend - bx.lo);
  if (dyn_size) memset(dyn_lo, 0xFF, dyn_size);
  memset(ready_bits, 0, sizeof ready_bits);
  for (uint32_t w = 0; w < (nthreads + 31) / 32; ++w) {
    warps[w].arrived = 0;
    wepoch[w] = 1;
  }
  for (uint32_t t = 0; t < nthreads; ++t) {
    Thr& x = thr[t];
    x.tid = t;
    x.fc = 0;
    x.acq.clear();
    x.pending.clear();
    set_ready(t);
  }
  for (;;) {
    const int t = pick();
    if (t >= 0) {
      resume(t);
      if (aborted) return;
      continue;
    }
    uint32_t live = 0, at_bar = 0, at_warp = 0;
    for (uint32_t i = 0; i < nthreads; ++i) {
      if (thr[i].st == EXITED) continue;
      ++live;
      at_bar += thr[i].st == WAIT_BAR;
      at_warp += thr[i].st == WAIT_WARP;
    }
    if (live == 0) return;
    if (at_warp == 0 && at_bar == live) {
      release_barrier();
      continue;
    }
    // deadlock: a warp collective some lane of its mask never reaches
    for (uint32_t i = 0; i < nthreads; ++i) {
      if (thr[i].st != WAIT_WARP) continue;
      const Warp& w = warps[i >> 5];
      char text[160];
      snprintf(text, sizeof text,
               "deadlock: %s of warp %u waits for lanes %08x (exited or at __syncthreads)",
               warp_op_name(w.op), i >> 5, w.mask & ~w.arrived);
      cur = &thr[i];
      report(R_DEADLOCK, 0, 0, 0, pc_off(w.pc), nullptr, text);
      cur = nullptr;
      break;
    }
    aborted = true;
    return;
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// The kernel side

extern "C" {

uint3 cuda_exec_thread_idx(void) {
  const uint32_t t = cur ? cur->tid : 0;
  uint3 r;
  r.x = t % block_dim.x;
  r.y = (t / block_dim.x) % block_dim.y;
  r.z = t / (block_dim.x * block_dim.y);
  return r;
}
uint3 cuda_exec_block_idx(void) { return block_idx; }
dim3 cuda_exec_block_dim(void) { return block_dim; }
dim3 cuda_exec_grid_dim(void) { return grid_dim; }

int cuda_exec_barrier(int kind, int pred, int line) {
  wait_barrier(kind, pred, __builtin_return_address(0), line);
  return bar_result;
}

unsigned long long cuda_exec_warp(int op, unsigned mask, unsigned long long v, int arg, int width,
                                  void* pc, int line) {
  return warp_op(op, mask, v, arg, width, pc, line);
}

unsigned cuda_exec_activemask(void) {
  const uint32_t wi = cur->tid >> 5;
  unsigned m = 0;
  for (uint32_t l = 0; l < 32 && wi * 32 + l < nthreads; ++l)
    if (thr[wi * 32 + l].st != EXITED) m |= 1u << l;
  return m;
}

void __threadfence(void) {
  Thr& me = *cur;
  if (me.fc < 0xFFFF) ++me.fc;
  join_into(me.acq, me.pending);
}
void __threadfence_block(void) {}
void __threadfence_system(void) { __threadfence(); }

void cuda_exec_atomic_note(void* p, unsigned size, void* pc) {
  if (!cur) return;
  access(p, size, A_READ | A_WRITE | A_ATOMIC, pc);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (find_box(a)) return;
  // a global atomic: observes earlier releases on this address, then
  // releases this block's fenced accesses (and what this thread acquired)
  Thr& me = *cur;
  SyncList& L = sync_vars[a];
  join_into(me.pending, L);
  SyncList mine;
  mine.push_back(my_snap(me));
  join_into(mine, me.acq);
  join_into(L, mine);
}

void cuda_exec_shared_decl(void* box, size_t size, size_t box_size) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(box);
  if (find_box(lo)) return;
  std::vector<Box>& v = *boxes;
  Box bx;
  bx.lo = lo;
  bx.vend = lo + size;
  bx.hi = lo + box_size;
  bx.shadow.resize((size + 3) / 4 + 1);
  memset(box, 0xFF, size);  // first use in this block: poisoned as at block start
  v.insert(std::upper_bound(v.begin(), v.end(), lo,
                            [](uintptr_t x, const Box& b) { return x < b.lo; }),
           std::move(bx));
  use_module(cur_module);
}

void* cuda_exec_dynamic_shared(void) { return dyn_lo; }

// -- sanitizer instrumentation hooks ------------------------------------------------
#define HOOKS(N)                                                                              \
  void __tsan_read##N(void* a) { access(a, N, A_READ, __builtin_return_address(0)); }          \
  void __tsan_write##N(void* a) { access(a, N, A_WRITE, __builtin_return_address(0)); }        \
  void __tsan_unaligned_read##N(void* a) { access(a, N, A_READ, __builtin_return_address(0)); } \
  void __tsan_unaligned_write##N(void* a) {                                                    \
    access(a, N, A_WRITE, __builtin_return_address(0));                                        \
  }                                                                                            \
  void __tsan_volatile_read##N(void* a) { access(a, N, A_READ, __builtin_return_address(0)); } \
  void __tsan_volatile_write##N(void* a) {                                                     \
    access(a, N, A_WRITE, __builtin_return_address(0));                                        \
  }
HOOKS(1)
HOOKS(2)
HOOKS(4)
HOOKS(8)
HOOKS(16)
#undef HOOKS
void __tsan_read_range(void* a, unsigned long n) {
  for (unsigned long i = 0; i < n; ++i) access(static_cast<char*>(a) + i, 1, A_READ, __builtin_return_address(0));
}
void __tsan_write_range(void* a, unsigned long n) {
  for (unsigned long i = 0; i < n; ++i) access(static_cast<char*>(a) + i, 1, A_WRITE, __builtin_return_address(0));
}
void __tsan_init(void) {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit(void) {}
void __tsan_vptr_update(void*, void*) {}
void __tsan_vptr_read(void*) {}

// ---------------------------------------------------------------------------
// The host side (ctypes, cuda_executor/_runtime.py)

int cuda_exec_report_size(void) { return static_cast<int>(sizeof(Report)); }

void cuda_exec_regions_clear(void) {
  for (Storage& s : storages) free(s.shadow);
  storages.clear();
  views.clear();
  merged.clear();
  views_dirty = false;
  sync_vars.clear();
}

void cuda_exec_region_add(uint64_t ptr, uint64_t nbytes, uint64_t base, uint64_t base_nbytes) {
  if (!nbytes) return;
  views.emplace_back(ptr, ptr + nbytes);
  views_dirty = true;
  uintptr_t lo = base, hi = base + base_nbytes;
  if (ptr < lo || ptr + nbytes > hi) {
    lo = ptr;
    hi = ptr + nbytes;
  }
  lo &= ~uintptr_t(3);
  // merge with every overlapping storage (their shadows are dropped)
  std::vector<Storage> keep;
  for (Storage& s : storages) {
    if (s.hi <= lo || s.lo >= hi) {
      keep.push_back(s);
    } else if (s.lo <= lo && hi <= s.hi) {
      return;  // already covered
    } else {
      lo = std::min(lo, s.lo);
      hi = std::max(hi, s.hi);
      free(s.shadow);
    }
  }
  keep.push_back(Storage{lo, hi, nullptr});
  std::sort(keep.begin(), keep.end(), [](const Storage& a, const Storage& b) { return a.lo < b.lo; });
  storages.swap(keep);
  last_storage = 0;
}

int cuda_exec_is_registered(uint64_t p) {
  if (views_dirty) rebuild_views();
  return in_views(p, p + 1) ? 1 : 0;
}

// Runs one launch; returns 0, or -1 if it was abandoned (fatal report).
int cuda_exec_launch(const cuda_exec::ModuleInfo* mod, unsigned k, const unsigned* grid,
                     const unsigned* block, unsigned long long shared_bytes, void** args, int pol,
                     unsigned long long seed, int preempt_mean, double timeout_s) {
  if (views_dirty) rebuild_views();
  reports.clear();
  report_index.clear();
  total_reports = 0;
  k_entry = &mod->kernels[k];
  k_args = args;
  Dl_info info;
  mod_base = dladdr(reinterpret_cast<void*>(k_entry->fn), &info) ? reinterpret_cast<uintptr_t>(info.dli_fbase) : 0;
  grid_dim.x = grid[0];
  grid_dim.y = grid[1];
  grid_dim.z = grid[2];
  block_dim.x = block[0];
  block_dim.y = block[1];
  block_dim.z = block[2];
  nthreads = block[0] * block[1] * block[2];
  if (nthreads == 0 || nthreads > kMaxThreads) return -2;
  policy = pol;
  rng_state = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
  if (!rng_state) rng_state = 1;
  preempt = pol == 2 ? preempt_mean : 0;
  preempt_left = preempt ? 1 + static_cast<int>(rnd() % (2 * preempt)) : 0;
  deadline = now() + timeout_s;
  aborted = false;
  ++launch_gen;
  sync_vars.clear();
  // shared memory: this module's variables, and the dynamic area
  use_module(mod);
  dyn_size = shared_bytes;
  dyn.assign(shared_bytes + CUDA_EXEC_REDZONE + 16, 0);
  dyn_lo = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(dyn.data()) + 15) & ~uintptr_t(15));
  dyn_box.lo = reinterpret_cast<uintptr_t>(dyn_lo);
  dyn_box.vend = dyn_box.lo + dyn_size;
  dyn_box.hi = dyn_box.vend + CUDA_EXEC_REDZONE;
  dyn_box.shadow.assign((dyn_size + 3) / 4 + 1, Cell());
  make_fibers(nthreads);
  const uint32_t nblocks = grid[0] * grid[1] * grid[2];
  std::vector<uint32_t> order(nblocks);
  for (uint32_t i = 0; i < nblocks; ++i) order[i] = pol == 1 ? nblocks - 1 - i : i;
  if (pol == 2)
    for (uint32_t i = nblocks; i > 1; --i) std::swap(order[i - 1], order[rnd() % i]);
  for (uint32_t b : order) {
    run_block(b);
    if (aborted) break;
  }
  cur = nullptr;
  if (aborted) {
    reset_fibers();
    return -1;
  }
  return 0;
}

int cuda_exec_report_count(void) { return static_cast<int>(reports.size()); }
unsigned cuda_exec_report_total(void) { return total_reports; }
void cuda_exec_report_get(int i, Report* out) { *out = reports[static_cast<size_t>(i)]; }

}  // extern "C"
