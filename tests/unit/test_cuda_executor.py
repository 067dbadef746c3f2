"""The CPU executor itself (cuda_executor/): CUDA semantics and checks.

Small kernels written for the purpose, each with a known right answer
(numpy) or a known bug the executor must report: races in shared and
global memory (a missing barrier, a missing __syncwarp, atomics made
plain, a missing fence in the last-block pattern), reads of unwritten
shared memory, out-of-bounds and redzone accesses, divergent barriers,
bad warp masks and deadlocks.  Correct kernels give the same results under
every schedule.  The mutation check over csrc/cuda (python -m
cuda_executor.mutations) runs as a slow test.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("g++") is None,
                                reason="CPU EXECUTOR NOT RUN: g++ not found (apt-get install g++)")

SOURCE = r"""
#define N 64
extern "C" __global__ void block_scan(const int* in, int* out) {  // inclusive, per block
  __shared__ int s[N];
  const int t = threadIdx.x, i = blockIdx.x * N + t;
  s[t] = in[i];
  __syncthreads();
  for (int o = 1; o < N; o <<= 1) {
    const int v = t >= o ? s[t - o] : 0;
    __syncthreads();
    s[t] += v;
    __syncthreads();
  }
  out[i] = s[t];
}
extern "C" __global__ void scan_missing_barrier(const int* in, int* out) {
  __shared__ int s[N];
  const int t = threadIdx.x;
  s[t] = in[t];
  const int v = t > 0 ? s[t - 1] : 0;  // the neighbour's write: no barrier between
  out[t] = v;
}
extern "C" __global__ void unwritten_shared(int* out) {
  __shared__ int s[N];
  const int t = threadIdx.x;
  if (t < N - 1) s[t] = t;
  __syncthreads();
  out[t] = s[N - 1 - t];  // thread 0 reads s[N - 1], never written
}
extern "C" __global__ void shared_overflow(int* out) {
  __shared__ int s[N];
  const int t = threadIdx.x;
  s[t + 1] = t;  // thread N - 1 writes one past the end
  __syncthreads();
  out[t] = 0;
}
extern "C" __global__ void shift_left(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i + 1];  // one past the end of x for i = n - 1
}
extern "C" __global__ void half_barrier(int* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1;
}
extern "C" __global__ void two_barriers(int* out) {
  if (threadIdx.x & 1) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}
extern "C" __global__ void barrier_votes(const int* p, int* out) {
  const int v = p[blockIdx.x * blockDim.x + threadIdx.x];
  const int a = __syncthreads_or(v), b = __syncthreads_and(v), c = __syncthreads_count(v);
  if (threadIdx.x == 5) {
    out[3 * blockIdx.x] = a;
    out[3 * blockIdx.x + 1] = b;
    out[3 * blockIdx.x + 2] = c;
  }
}
extern "C" __global__ void shuffles(const long long* v, long long* out) {
  const int t = threadIdx.x;
  const long long x = v[t];
  out[8 * t + 0] = __shfl_sync(0xFFFFFFFFu, x, (t * 7) & 31);
  out[8 * t + 1] = __shfl_up_sync(0xFFFFFFFFu, x, 3);
  out[8 * t + 2] = __shfl_down_sync(0xFFFFFFFFu, x, 5);
  out[8 * t + 3] = __shfl_xor_sync(0xFFFFFFFFu, x, 6);
  out[8 * t + 4] = __shfl_up_sync(0xFFFFFFFFu, x, 1, 8);
  out[8 * t + 5] = __ballot_sync(0xFFFFFFFFu, x & 1);
  out[8 * t + 6] = __any_sync(0xFFFFFFFFu, x > 90);
  out[8 * t + 7] = __all_sync(0xFFFFFFFFu, x >= 0);
}
extern "C" __global__ void shuffle_mask_without_me(int* out) {
  out[threadIdx.x] = __shfl_sync(0x0000FFFFu, static_cast<int>(threadIdx.x), 0);
}
extern "C" __global__ void shuffle_half_warp(int* out) {
  int v = threadIdx.x;
  if (threadIdx.x < 16) v = __shfl_sync(0xFFFFFFFFu, v, 0);  // lanes 16..31 never come
  out[threadIdx.x] = v;
}
extern "C" __global__ void warp_exchange(const int* in, int* out, int sync) {
  __shared__ int s[32];
  const int l = threadIdx.x;
  s[l] = in[l];
  if (sync) __syncwarp();
  out[l] = s[l ^ 1];
}
extern "C" __global__ void shared_count(const int* bins, unsigned* out, int atomic) {
  __shared__ unsigned h[4];
  const int t = threadIdx.x;
  if (t < 4) h[t] = 0;
  __syncthreads();
  if (atomic) atomicAdd(&h[bins[t]], 1u); else h[bins[t]] += 1u;
  __syncthreads();
  if (t < 4) out[t] = h[t];
}
extern "C" __global__ void global_count(unsigned long long* c, int atomic) {
  if (threadIdx.x == 0) {
    if (atomic) atomicAdd(c, 1ull); else *c += 1ull;
  }
}
// The last-block pattern: every block adds into sum, the last to take a
// ticket reads it.  fence_release / fence_acquire: the two __threadfence.
extern "C" __global__ void last_block(const unsigned* v, unsigned* sum, unsigned* ticket,
                                     unsigned* result, int fence_release, int fence_acquire) {
  __shared__ int last;
  atomicAdd(sum, v[blockIdx.x * blockDim.x + threadIdx.x]);
  if (fence_release) __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  if (fence_acquire) __threadfence();
  if (threadIdx.x == 0) *result = *sum;
}
extern "C" __global__ void dynamic_shared(const float* x, float* y, int n, int over) {
  extern __shared__ float buf[];
  const int t = threadIdx.x;
  buf[t + (over && t == 0 ? n : 0)] = x[t];
  __syncthreads();
  y[t] = buf[n - 1 - t];
}
extern "C" __global__ void halves(const unsigned short* h, float* f, const float* g,
                                  unsigned short* hg, long long n) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    f[i] = __half2float(__ushort_as_half(h[i]));
    hg[i] = __half_as_ushort(__float2half_rn(g[i]));
  }
}
"""


@pytest.fixture(scope="module")
def module():
    from cuda_executor import Executor

    ex = Executor()
    return ex.cupy.RawModule(code=SOURCE, options=("--std=c++14",))


def run(module, name, grid, block, args, schedule="forward", seed=0, shared_mem=0):
    from cuda_executor import Executor

    ex = Executor(schedule=schedule, seed=seed)
    module.executor = ex
    module.get_function(name)((grid,), (block,), tuple(ex.ptr(a) if torch.is_tensor(a) else a
                                                      for a in args), shared_mem=shared_mem)
    return ex


def reported(module, name, grid, block, args, **kw):
    """The report kinds of a launch that must fail (ExecutorError)."""
    from cuda_executor import ExecutorError

    with pytest.raises(ExecutorError) as e:
        run(module, name, grid, block, args, **kw)
    return set(e.value.kinds), str(e.value)


SCHEDULES = [("forward", 0), ("reverse", 0), ("random", 1), ("random", 2)]


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_correct_kernels_agree_under_every_schedule(module, schedule, seed):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-50, 50, (4 * 64,), generator=g, dtype=torch.int32)
    out = torch.zeros_like(x)
    run(module, "block_scan", 4, 64, (x, out), schedule, seed)
    np.testing.assert_array_equal(out.numpy(), np.cumsum(x.view(4, 64).numpy(), axis=1).ravel())
    p = (torch.rand(3 * 64, generator=g) < torch.tensor([0.0, 1.0, 0.3]).repeat_interleave(64)).int()
    votes = torch.zeros(9, dtype=torch.int32)
    run(module, "barrier_votes", 3, 64, (p, votes), schedule, seed)
    pb = p.view(3, 64)
    want = torch.stack([pb.any(1).int(), pb.all(1).int(), pb.sum(1).int()], 1).ravel()
    assert votes.tolist() == want.tolist()
    v = torch.randint(0, 100, (64,), generator=g, dtype=torch.int64)
    out = torch.zeros(64 * 8, dtype=torch.int64)
    run(module, "shuffles", 1, 64, (v, out), schedule, seed)
    o, vv = out.view(64, 8).numpy(), v.numpy()
    for t in range(64):
        w, lane = 32 * (t // 32), t % 32
        seg = t - t % 8
        assert o[t, 0] == vv[w + (lane * 7) % 32]
        assert o[t, 1] == (vv[t - 3] if lane >= 3 else vv[t])
        assert o[t, 2] == (vv[t + 5] if lane + 5 < 32 else vv[t])
        assert o[t, 3] == vv[w + (lane ^ 6)]
        assert o[t, 4] == (vv[t - 1] if t - seg >= 1 else vv[t])
        assert o[t, 5] == sum(1 << i for i in range(32) if vv[w + i] & 1)
        assert o[t, 6] == int((vv[w:w + 32] > 90).any())
        assert o[t, 7] == 1
    bins = torch.randint(0, 4, (128,), generator=g, dtype=torch.int32)
    counts = torch.zeros(4, dtype=torch.int32)
    run(module, "shared_count", 1, 128, (bins, counts, np.int32(1)), schedule, seed)
    assert counts.tolist() == torch.bincount(bins, minlength=4).tolist()
    c = torch.zeros(1, dtype=torch.int64)
    run(module, "global_count", 37, 32, (c, np.int32(1)), schedule, seed)
    assert c.item() == 37
    vals = torch.randint(0, 1000, (6 * 32,), generator=g, dtype=torch.int32)
    s, tk, res = (torch.zeros(1, dtype=torch.int32) for _ in range(3))
    run(module, "last_block", 6, 32, (vals, s, tk, res, np.int32(1), np.int32(1)), schedule, seed)
    assert res.item() == vals.sum().item()


def test_random_schedules_are_seeded(module):
    """Same seed, same interleaving: the lost updates of a racy count repeat."""
    from cuda_executor import Executor, ExecutorError

    bins = torch.zeros(256, dtype=torch.int32)
    got = []
    for seed in (5, 5, 6):
        ex = Executor(schedule="random", seed=seed, strict=False)
        module.executor = ex
        counts = torch.zeros(4, dtype=torch.int32)
        module.get_function("shared_count")((1,), (256,), (ex.ptr(bins), ex.ptr(counts), np.int32(0)))
        got.append(counts[0].item())
        assert ex.report_kinds and set(ex.report_kinds) <= {1, 2, 3}
    assert got[0] == got[1] and got[0] < 256  # preemption inside the plain += loses updates
    with pytest.raises(ExecutorError):
        run(module, "shared_count", 1, 256, (bins, torch.zeros(4, dtype=torch.int32), np.int32(0)))


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_races_are_reported_under_every_schedule(module, schedule, seed):
    x = torch.arange(64, dtype=torch.int32)
    kinds, msg = reported(module, "scan_missing_barrier", 1, 64, (x, torch.zeros(64, dtype=torch.int32)),
                          schedule=schedule, seed=seed)
    assert 1 in kinds or 3 in kinds  # read after write, or write after read
    assert "s[t] = in[t]" in msg or "s[t - 1]" in msg  # names the source lines
    bins = torch.randint(0, 4, (128,), dtype=torch.int32)
    kinds, _ = reported(module, "shared_count", 1, 128, (bins, torch.zeros(4, dtype=torch.int32),
                                                          np.int32(0)), schedule=schedule, seed=seed)
    assert kinds & {1, 2, 3}
    kinds, _ = reported(module, "global_count", 5, 32, (torch.zeros(1, dtype=torch.int64), np.int32(0)),
                        schedule=schedule, seed=seed)
    assert kinds & {1, 2, 3}  # plain += by one thread of each block: blocks race


def test_warp_synchronous_code_needs_syncwarp(module):
    x = torch.arange(32, dtype=torch.int32)
    out = torch.zeros(32, dtype=torch.int32)
    run(module, "warp_exchange", 1, 32, (x, out, np.int32(1)), "random", 3)
    assert out.tolist() == [i ^ 1 for i in range(32)]
    for schedule, seed in SCHEDULES:
        kinds, _ = reported(module, "warp_exchange", 1, 32, (x, out, np.int32(0)),
                            schedule=schedule, seed=seed)
        assert kinds & {1, 3}


@pytest.mark.parametrize("release,acquire", [(0, 1), (1, 0), (0, 0)])
def test_last_block_pattern_needs_both_fences(module, release, acquire):
    vals = torch.ones(4 * 32, dtype=torch.int32)
    bufs = [torch.zeros(1, dtype=torch.int32) for _ in range(3)]
    kinds, msg = reported(module, "last_block", 4, 32,
                          (vals, *bufs, np.int32(release), np.int32(acquire)))
    assert 1 in kinds and "*result = *sum" in msg  # the read of another block's atomics


def test_unwritten_shared_memory_is_reported(module):
    kinds, _ = reported(module, "unwritten_shared", 1, 64, (torch.zeros(64, dtype=torch.int32),))
    assert kinds == {4}


def test_out_of_bounds_accesses_are_reported(module):
    x, y = torch.randn(100), torch.zeros(100)
    run(module, "shift_left", 2, 64, (x, y, np.int32(99)))
    assert torch.equal(y[:99], x[1:])
    kinds, msg = reported(module, "shift_left", 2, 64, (x, y, np.int32(100)))
    assert kinds == {5} and "abandoned" in msg  # before the access: nothing read
    kinds, _ = reported(module, "shared_overflow", 1, 64, (torch.zeros(64, dtype=torch.int32),))
    assert kinds == {6}


def test_dynamic_shared_memory(module):
    x = torch.arange(32, dtype=torch.float32)
    y = torch.zeros(32)
    run(module, "dynamic_shared", 1, 32, (x, y, np.int32(32), np.int32(0)), shared_mem=128)
    assert y.tolist() == x.flip(0).tolist()
    kinds, _ = reported(module, "dynamic_shared", 1, 32, (x, y, np.int32(32), np.int32(1)),
                        shared_mem=128)
    assert 6 in kinds


def test_barrier_and_warp_misuse_is_reported(module):
    out = torch.zeros(64, dtype=torch.int32)
    assert 8 in reported(module, "half_barrier", 1, 32, (out,))[0]
    assert 9 in reported(module, "two_barriers", 1, 32, (out,))[0]
    assert 10 in reported(module, "shuffle_mask_without_me", 1, 32, (out,))[0]
    assert 13 in reported(module, "shuffle_half_warp", 1, 32, (out,))[0]


def test_launch_arguments_are_checked(module):
    from cuda_executor import Executor

    ex = Executor()
    module.executor = ex
    f = module.get_function("shift_left")
    x, y = torch.randn(8), torch.zeros(8)
    with pytest.raises(TypeError, match="3 parameters"):
        f((1,), (8,), (ex.ptr(x), ex.ptr(y)))
    with pytest.raises(TypeError, match="takes 4"):
        f((1,), (8,), (ex.ptr(x), ex.ptr(y), np.int64(8)))
    with pytest.raises(ValueError, match="registered"):
        f((1,), (8,), (ex.ptr(x), np.uint64(torch.zeros(8).data_ptr()), np.int32(8)))
    with pytest.raises(AttributeError, match="no kernel"):
        module.get_function("missing")


def test_fp16_conversions_match_torch(module):
    """__half2float on every half, __float2half_rn on random floats of
    every scale, the halves themselves, the ties between neighbours and the
    edges (overflow, subnormals, Inf, NaN): torch's conversions on the CPU."""
    g = torch.Generator().manual_seed(3)
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    fin = every[torch.isfinite(every)].unique()
    f32 = torch.cat([torch.randn(40_000, generator=g) * 10.0 ** torch.randint(-9, 6, (40_000,), generator=g),
                     every, (fin[:-1] + fin[1:]) / 2,
                     torch.tensor([65504.0, 65519.99, 65520.0, 1e-8, 2.0 ** -25, 2.0 ** -24 * 1.5,
                                   float("inf"), -float("inf"), float("nan")])])
    n = f32.numel()
    h = torch.zeros(n, dtype=torch.int16)
    h[:65536] = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    f, hg = torch.zeros(n), torch.zeros(n, dtype=torch.int16)
    run(module, "halves", (n + 255) // 256, 256, (h, f, f32, hg, np.int64(n)))
    want = h.view(torch.float16).float()
    assert torch.equal(torch.isnan(f), torch.isnan(want))
    assert torch.equal(f[~torch.isnan(f)].view(torch.int32), want[~torch.isnan(want)].view(torch.int32))
    want_h = f32.half()
    nan = torch.isnan(want_h)
    assert torch.equal(torch.isnan(hg.view(torch.float16)), nan)
    assert torch.equal(hg[~nan], want_h.view(torch.int16)[~nan])


def test_builds_are_cached_by_source_hash():
    from cuda_executor import _build

    code = 'extern "C" __global__ void k(int* p) { p[threadIdx.x] = 1; }\n'
    so, names = _build.build_module(code)
    assert names == ["k"]
    stamp = so.stat().st_mtime_ns
    assert _build.build_module(code)[0] == so and so.stat().st_mtime_ns == stamp
    so2, _ = _build.build_module(code.replace("1;", "2;"))
    assert so2 != so and so2.exists()
    with pytest.raises(_build.BuildError):
        _build.build_module('extern "C" __global__ void k(int* p) { undefined_thing(); }\n')


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_mutation_check_catches_injected_bugs(tmp_path):
    """python -m cuda_executor.mutations: the unmodified kernels pass under
    every schedule, and at least 18 of the injected bugs are caught (about
    15 minutes on two cores)."""
    out = tmp_path / "mutations.json"
    r = subprocess.run([sys.executable, "-m", "cuda_executor.mutations", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=7200)
    print(r.stdout[-6000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["baseline_passed"] and res["total"] >= 20 and res["caught"] >= 18


def test_every_mutation_applies_to_the_sources():
    """The mutation check's bugs still match the kernels' text (each once)."""
    from cuda_executor.mutations import MUTATIONS, mutated_sources

    assert len(MUTATIONS) >= 20 and len({m.name for m in MUTATIONS}) == len(MUTATIONS)
    base = mutated_sources(None)
    for m in MUTATIONS:
        assert mutated_sources(m) != base, m.name
