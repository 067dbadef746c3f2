"""The CUDA back end (csrc/cuda through CuPy).

Three kinds of checks:

1. **Compile** (needs only ``nvcc``, no GPU): every csrc/cuda file compiles
   with nvcc for sm_80 and sm_90 (one invocation, ``-Xptxas -v`` output kept
   in the test's tmp directory and printed), with warnings as errors, no
   register spills and no local memory; every kernel name
   ``gtopk_plugin/kernels/cuda.py`` launches exists; the self-contained text
   handed to NVRTC (includes pasted in) compiles too and includes no header.
   Skips loudly only when nvcc is absent.
2. **Algorithm models** (CPU): numpy models of the radix-select state machine
   and of the threshold rule as the kernels implement them (same digit
   schedule, candidate capacities, composite key) against the reference:
   what can be checked of the kernels' logic without a GPU.
3. **Correctness on a device**, parametrized over "cuda" (a GPU with CuPy;
   skipped without one) and "executor" (the CPU executor of cuda_executor/:
   the real kernels compiled by g++ and run with sanitizer checks, in CI):
   every kernel against the reference on the same device, bit for bit, and
   the numpy oracles: ties, -0.0, NaN/Inf, denormals, k = 0, 1, n, n + 1,
   empty and tiny segments, segments large enough for several blocks,
   candidate buffers and heavy ties, every dtype and both index widths; plus
   the host code's other paths (fallbacks to the reference, errors) on the
   executor.

Plus the dispatch: without CuPy, CUDA tensors use the reference after
exactly one warning naming ``pip install gtopk-plugin[cuda]``.
"""
import hashlib
import math
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from gtopk_plugin import kernels
from gtopk_plugin.kernels import cuda, reference
from oracles import merge_np, topk_np

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "csrc" / "cuda"
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64,
            torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _nvcc():
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.exists(cand):
            return cand
    return None


def _skip_no_nvcc():
    msg = ("NVCC NOT FOUND: the CUDA kernels (csrc/cuda) were NOT compile-checked; "
           "install the CUDA toolkit (nvcc) to run this test")
    warnings.warn(msg)
    pytest.skip(msg)


# ---------------------------------------------------------------------------
# 1. Compile checks (nvcc, no GPU needed)

def _nice():
    return ["nice", "-n", "19"] if shutil.which("nice") else []


@pytest.fixture(scope="module")
def ptxas_log(tmp_path_factory):
    """Compile every csrc/cuda/*.cu for sm_80 and sm_90 in one nvcc call."""
    nvcc = _nvcc()
    if nvcc is None:
        _skip_no_nvcc()
    out = tmp_path_factory.mktemp("nvcc")
    files = sorted(str(p) for p in CUDA_DIR.glob("*.cu"))
    assert files, "no csrc/cuda/*.cu"
    cmd = _nice() + [nvcc, "-fatbin", "-std=c++14",
                     "-gencode", "arch=compute_80,code=sm_80",
                     "-gencode", "arch=compute_90,code=sm_90",
                     "-Xptxas", "-v,-warn-spills,-warn-lmem-usage", "-Werror", "all-warnings",
                     "-I", str(CUDA_DIR), "-odir", str(out)] + files
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    log = r.stdout + r.stderr
    (out / "ptxas.log").write_text(" ".join(cmd) + "\n" + log)
    print(f"\nnvcc -Xptxas -v output kept in {out / 'ptxas.log'}")
    assert r.returncode == 0, f"nvcc failed:\n{log[-8000:]}"
    return log


def test_nvcc_compiles_every_file_for_sm80_and_sm90(ptxas_log):
    for arch in ("sm_80", "sm_90"):
        assert f"for '{arch}'" in ptxas_log, f"nothing compiled for {arch}"
    # resources: no spills, no local memory, the static shared memory fits
    # the 48 KiB every launch gets without opting in
    assert not re.search(r"[1-9]\d* bytes spill (stores|loads)", ptxas_log), ptxas_log
    for m in re.finditer(r"(\d+) bytes smem", ptxas_log):
        assert int(m.group(1)) <= 48 * 1024
    for m in re.finditer(r"Used (\d+) registers", ptxas_log):
        assert int(m.group(1)) <= 255


def test_every_launched_kernel_exists(ptxas_log):
    compiled = set(re.findall(r"Compiling entry function '(\w+)' for 'sm_80'", ptxas_log))
    for f, names in cuda.kernel_names().items():
        missing = [n for n in names if n not in compiled]
        assert not missing, f"{f}: kernels launched by cuda.py but not compiled: {missing}"


@pytest.fixture(scope="module")
def nvrtc_ptx(tmp_path_factory):
    """PTX of the self-contained text NVRTC compiles (includes pasted in), as
    {kernel name: [parameter sizes in bytes]}."""
    nvcc = _nvcc()
    if nvcc is None:
        _skip_no_nvcc()
    out = tmp_path_factory.mktemp("nvrtc")
    files = []
    for f, code in cuda.sources().items():
        path = out / f"nvrtc_{f}"
        path.write_text(code)
        files.append(str(path))
    r = subprocess.run(_nice() + [nvcc, "-ptx", "-std=c++14", "-arch=compute_80",
                                  "-odir", str(out)] + files,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    entries = {}
    for ptx in out.glob("*.ptx"):
        for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx.read_text(), re.S):
            entries[m.group(1)] = [int(b) // 8 for b in re.findall(r"\.param\s+\.[usb](\d+)", m.group(2))]
    return entries


def test_nvrtc_text_is_self_contained(nvrtc_ptx):
    """What NVRTC compiles: no #include left (NVRTC has no host headers),
    and each file compiles for sm_80 as a single translation unit."""
    srcs = cuda.sources()
    assert set(srcs) == set(cuda.FILES) == {p.name for p in CUDA_DIR.glob("*.cu")}
    for f, code in srcs.items():
        assert not re.search(r"^\s*#\s*include", code, re.M), f"{f} still includes a header"
    # raw files include only their own local headers
    for p in CUDA_DIR.iterdir():
        for inc in re.findall(r'^\s*#\s*include\s*([<"][^>"]+[>"])', p.read_text(), re.M):
            assert inc.startswith('"') and (CUDA_DIR / inc.strip('"')).exists(), (p.name, inc)
    for names in cuda.kernel_names().values():
        assert set(names) <= set(nvrtc_ptx)


def test_package_data_ships_the_cuda_sources():
    text = (ROOT / "setup.py").read_text()
    assert '"cuda/*.cu"' in text and '"cuda/*.cuh"' in text
    assert re.search(r'"cuda":\s*\["cupy-cuda12x', text)


# ---------------------------------------------------------------------------
# 2. Algorithm models (numpy, CPU): the kernels' logic against the reference

_KEY = {torch.float32: (np.uint32, 0x7FFFFFFF, 0x7F800000),
        torch.float64: (np.uint64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
        torch.float16: (np.uint16, 0x7FFF, 0x7C00),
        torch.bfloat16: (np.uint16, 0x7FFF, 0x7F80)}


def keys_np(x: torch.Tensor) -> np.ndarray:
    """common.cuh's magnitude keys."""
    view, mask, inf = _KEY[x.dtype]
    b = x.view(INT_VIEW[x.dtype]).numpy().view(view).astype(np.uint64) & np.uint64(mask)
    return np.minimum(b, np.uint64(inf))


def pass_spec(p, kbits, wbits):
    nk = -(-kbits // cuda.DIGIT)
    if p < nk:
        word, top = 0, kbits - cuda.DIGIT * p
    else:
        word, top = 1, wbits - cuda.DIGIT * (p - nk)
    w = min(top, cuda.DIGIT)
    return word, top - w, w


def model_radix(key, inv, valid, k, kbits, wbits, cap, start=None):
    """radix.cuh's state machine for one segment, pass by pass (blocks,
    tickets and scans aside): the selected item positions, and the modes
    visited (to check that the tests reach every path).  ``start``: the
    candidates of a sampled start (select.cu's bound), read instead of x."""
    n = key.size
    R = min(k, n) if k > 0 else 0
    KP = IP = B = 0
    FIN = math.inf if R > 0 else -1
    SRC = DST = 0
    SRCN = 0
    cand = {1: None, 2: None}
    if start is not None:
        SRC, SRCN, cand[1] = 1, start.size, start
    emitted = []
    modes = set()
    npass = cuda._passes(kbits, wbits)
    for j in range(npass + 1):
        if FIN < j:
            break
        fin = FIN == j
        assert fin or j < npass, "the last digit must finish every segment"
        if SRC:
            items = cand[SRC]
            assert items.size == SRCN
            modes.add("cand")
        else:
            items = np.arange(n)
            modes.add("x")
        items = items[valid[items]]
        kk, iv = key[items], inv[items]
        surv = np.ones(items.size, bool)
        if j > 0:
            word, sh, w = pass_spec(j - 1, kbits, wbits)
            if word == 0:
                match = (kk >> np.uint64(sh + w)) == np.uint64(KP)
            else:
                match = (kk == np.uint64(KP)) & ((iv >> np.uint64(sh + w)) == np.uint64(IP))
            d = ((iv if word else kk) >> np.uint64(sh)) & np.uint64((1 << w) - 1)
            em = match & ((d > np.uint64(B)) | (fin & (d == np.uint64(B))))
            emitted.extend(items[em].tolist())
            surv = match & (d == np.uint64(B)) & (not fin)
        if fin:
            FIN = -2  # done
            break
        sitems = items[surv]
        to_cand = j > 0 and DST
        out_id = 2 if SRC == 1 else 1
        if to_cand:
            assert sitems.size <= cap
            cand[out_id] = sitems
        word2, sh2, w2 = pass_spec(j, kbits, wbits)
        dig = (((iv[surv] if word2 else kk[surv]) >> np.uint64(sh2)) & np.uint64((1 << w2) - 1))
        hist = np.bincount(dig.astype(np.int64), minlength=cuda.BINS)
        total = int(sitems.size)
        r = min(R, total) if j == 0 else R
        if r <= 0:
            FIN = -1
            break
        cum = 0
        for b in range(cuda.BINS - 1, -1, -1):
            if cum + hist[b] >= r:
                break
            cum += hist[b]
        hb, rem = int(hist[b]), r - cum
        assert 1 <= rem <= hb
        if j > 0:
            word, sh, w = pass_spec(j - 1, kbits, wbits)
            if word == 0:
                KP = (KP << w) | B
            else:
                IP = (IP << w) | B
        if to_cand:
            SRC, SRCN = out_id, total
        B, R = b, rem
        if rem == hb:
            FIN = j + 1
        else:
            DST = int(hb <= cap)
    assert len(emitted) == (min(k, int(valid.sum())) if k > 0 else 0)
    return np.sort(np.array(emitted, dtype=np.int64)), modes


def sample_positions(n):
    """select.cu's sample (reference.threshold_sample_positions)."""
    p = np.arange(min(n, cuda.KERNEL_SAMPLE))
    if n > cuda.KERNEL_SAMPLE:
        p = (p // cuda.KERNEL_RUN) * (n // (cuda.KERNEL_SAMPLE // cuda.KERNEL_RUN)) + p % cuda.KERNEL_RUN
    return p


def model_bound_start(kseg, k, cap):
    """select.cu's sampled start: the candidates >= the bound, or None."""
    n = kseg.size
    R = cuda._bound_rank(n, k, cap)
    if R <= 0:
        return None
    L = np.sort(kseg[sample_positions(n)])[::-1][R - 1]
    ge = np.flatnonzero(kseg >= L)
    return ge if (min(k, n) <= ge.size <= cap and ge.size > 0) else None


def model_select_topk(x, offsets, ks, cap_fn=cuda._cand_capacity, bound=True):
    key = keys_np(x)
    kbits = cuda._VALUES[x.dtype][1]
    sizes = [offsets[s + 1] - offsets[s] for s in range(len(ks))]
    wbits = max(1, (max(sizes, default=1) - 1).bit_length())
    out, modes = [], set()
    for s, k in enumerate(ks):
        lo, hi = offsets[s], offsets[s + 1]
        n = hi - lo
        inv = (n - 1 - np.arange(n)).astype(np.uint64)
        cap = cap_fn(n, k)
        start = model_bound_start(key[lo:hi], k, cap) if bound else None
        if start is not None:
            modes.add("bound")
        sel, m = model_radix(key[lo:hi], inv, np.ones(n, bool), k, kbits, wbits, cap, start)
        out.append(sel + lo)
        modes |= m
    return (np.concatenate(out) if out else np.zeros(0, np.int64)), modes


def _ref_idx(x, offsets, ks):
    idx, _ = reference.select_topk(x, torch.tensor(offsets), torch.tensor(ks))
    return idx.long().numpy()


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_radix_random_ties_specials(dtype):
    g = torch.Generator().manual_seed(1)
    n = 3000
    x = torch.randn(n, generator=g).to(dtype)
    x[::7] = 0.5
    x[::11] = -0.5
    x[5:40] = 0.0
    x[40:50] = -0.0
    x[50] = float("nan")
    x[51] = float("inf")
    x[52] = -float("inf")
    x[60:64] = torch.tensor([1e-40, -1e-42, 1e-45, 3e-39]).to(dtype)
    offsets = [0, 0, 1, 3, 100, 1100, 3000]
    for ks in ([0, 1, 1, 50, 300, 1900], [5, 5, 2, 97, 1000, 1], [3, 1, 3, 98, 1001, 2000]):
        got, _ = model_select_topk(x, offsets, ks)
        np.testing.assert_array_equal(got, _ref_idx(x, offsets, ks))
        np.testing.assert_array_equal(got, topk_np(x, offsets, [max(0, min(k, offsets[s + 1] - offsets[s]))
                                                                for s, k in enumerate(ks)]))


def test_model_radix_reaches_candidates_and_heavy_ties():
    """Large segments: candidate buffers (random data), x re-read under heavy
    ties (all zeros but a few: the index digits decide), and a capacity of 0
    (every pass from x)."""
    g = torch.Generator().manual_seed(2)
    n = 200_000
    x = torch.randn(n, generator=g)
    z = torch.zeros(n)
    z[[5, 77, 100_000]] = torch.tensor([1.0, -2.0, 0.5])
    for data, k in ((x, 2000), (x, 1), (x, n - 1), (z, 1000), (z, 2), (x, 60_000)):
        for cap_fn in (cuda._cand_capacity, lambda n, k: 0):
            for bound in (True, False):
                got, modes = model_select_topk(data, [0, n], [k], cap_fn, bound)
                np.testing.assert_array_equal(got, _ref_idx(data, [0, n], [k]))
    _, modes = model_select_topk(x, [0, n], [2000], bound=False)
    assert modes == {"x", "cand"}
    _, modes = model_select_topk(x, [0, n], [2000])
    assert modes == {"bound", "cand"}  # x is never read by the passes
    _, modes = model_select_topk(z, [0, n], [1000])
    assert "cand" in modes and "bound" not in modes  # ties at the bound: too many


def test_model_merge_union():
    """merge.cu's union layout and duplicate folding + the radix select
    against reference.merge_select (selected indices and survivor flags)."""
    g = torch.Generator().manual_seed(3)
    offsets = [0, 500, 520, 3000]
    ks = [40, 0, 200]
    for dtype in DTYPES:
        ia = torch.sort(torch.randperm(3000, generator=g)[:900]).values
        ib = torch.sort(torch.randperm(3000, generator=g)[:700]).values
        va = torch.randn(900, generator=g).to(dtype)
        vb = torch.randn(700, generator=g).to(dtype)
        vb[:50] = 0.25
        va[:50] = -0.25
        ref = reference.merge_select(ia, va, ib, vb, torch.tensor(offsets), torch.tensor(ks))
        a_np, b_np = ia.numpy(), ib.numpy()
        S = len(ks)
        ab = np.searchsorted(a_np, offsets)
        bb = np.searchsorted(b_np, offsets)
        na, nb = a_np.size, b_np.size
        uidx = np.zeros(na + nb, np.int64)
        uval = torch.zeros(na + nb, dtype=dtype)
        valid = np.zeros(na + nb, bool)
        posa, posb = np.zeros(na, np.int64), np.zeros(nb, np.int64)
        for i in range(na):
            s = np.searchsorted(ab, i, side="right") - 1
            p = i + bb[s]
            j = np.searchsorted(b_np, a_np[i])
            v = torch.zeros((), dtype=dtype) + va[i]
            if j < nb and b_np[j] == a_np[i]:
                v = v + vb[j]
            uidx[p], uval[p], valid[p], posa[i] = a_np[i], v, True, p
        for j in range(nb):
            s = np.searchsorted(bb, j, side="right") - 1
            p = ab[s + 1] + j
            i = np.searchsorted(a_np, b_np[j])
            dup = i < na and a_np[i] == b_np[j]
            uidx[p], uval[p], valid[p] = b_np[j], torch.zeros((), dtype=dtype) + vb[j], not dup
            posb[j] = i + bb[s] if dup else p
        key = keys_np(uval)
        kbits = cuda._VALUES[dtype][1]
        wbits = max(1, (max(offsets[s + 1] - offsets[s] for s in range(S)) - 1).bit_length())
        sel = np.zeros(na + nb, bool)
        for s in range(S):
            lo, hi = ab[s] + bb[s], ab[s + 1] + bb[s + 1]
            inv = (offsets[s + 1] - 1 - uidx[lo:hi]).astype(np.uint64)
            got, _ = model_radix(key[lo:hi], inv, valid[lo:hi], ks[s], kbits, wbits,
                                 cuda._cand_capacity(hi - lo, ks[s]))
            sel[got + lo] = True
        np.testing.assert_array_equal(np.sort(uidx[sel]), ref[0].long().numpy())
        np.testing.assert_array_equal(sel[posa], ref[2].numpy())
        np.testing.assert_array_equal(sel[posb], ref[3].numpy())
        # values: the union sums the reference computes
        order = np.argsort(uidx[sel])
        np.testing.assert_array_equal(uval[torch.from_numpy(np.flatnonzero(sel)[order])]
                                      .view(INT_VIEW[dtype]).numpy(),
                                      ref[1].view(INT_VIEW[dtype]).numpy())


def model_threshold(x, offsets, ks):
    """select.cu's threshold path: host parameters (cuda._threshold_params),
    the kernel's sample positions and rank, count, decide, exact fallback."""
    key = keys_np(x)
    out = []
    for s, k in enumerate(ks):
        lo, hi = offsets[s], offsets[s + 1]
        n = hi - lo
        tpar, cmin, cmax, slots = cuda._threshold_params(n, k)
        kseg = key[lo:hi]
        if tpar == 0:
            t = 0
        elif tpar < 0:
            t = 2**64 - 1
        else:
            if n <= cuda.KERNEL_SAMPLE:
                pos = np.arange(n)
            else:
                p = np.arange(cuda.KERNEL_SAMPLE)
                pos = (p // cuda.KERNEL_RUN) * (n // (cuda.KERNEL_SAMPLE // cuda.KERNEL_RUN)) \
                    + p % cuda.KERNEL_RUN
            samp = np.sort(kseg[pos])[::-1]
            t = int(samp[tpar - 1])
        ge = np.flatnonzero(kseg >= np.uint64(min(t, 2**64 - 1)))
        r0 = max(0, min(k, n))
        if (cmin <= ge.size <= cmax) or r0 == 0:
            assert ge.size <= slots
            out.append(ge + lo)
        else:
            inv = (n - 1 - np.arange(n)).astype(np.uint64)
            sel, _ = model_radix(kseg, inv, np.ones(n, bool), k, cuda._VALUES[x.dtype][1],
                                 max(1, (n - 1).bit_length()), cuda._cand_capacity(n, k))
            out.append(sel + lo)
    return np.concatenate(out) if out else np.zeros(0, np.int64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_threshold_matches_reference(dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(60_000, generator=g).to(dtype)
    x[30_000:40_000] = 0.75  # a plateau: "too many" for some k
    x[100] = float("nan")
    offsets = [0, 0, 10, 4096, 5000, 30_000, 45_000, 60_000]
    for ks in ([1, 3, 40, 9, 250, 3000, 20], [0, 10, 4096, 900, 25_000, 100, 15_000],
               [5, 11, 1, 1, 1, 1, 1]):
        ref, _ = reference.select_threshold(x, torch.tensor(offsets), torch.tensor(ks))
        np.testing.assert_array_equal(model_threshold(x, offsets, ks), ref.long().numpy())


def test_threshold_params_follow_the_reference_constants():
    for n, k in ((10, 3), (5000, 5), (10**6, 10**4), (10**8, 10**5), (7, 7), (7, 0)):
        tpar, cmin, cmax, slots = cuda._threshold_params(n, k)
        if 0 < k < n:
            assert 1 <= tpar <= min(n, cuda.KERNEL_SAMPLE)
            assert cmin == math.ceil(0.9 * k) and cmax == math.floor(1.1 * k)
            assert slots >= max(cmax, k)
    assert (reference.THRESHOLD_SAMPLE, reference.THRESHOLD_RUN) == (cuda.KERNEL_SAMPLE,
                                                                    cuda.KERNEL_RUN)


# ---------------------------------------------------------------------------
# 3. Dispatch and the fallback without CuPy (no GPU needed)

@pytest.fixture
def fresh_cuda_registry(monkeypatch):
    """Isolates kernels' back-end registry and cuda.py's load state."""
    monkeypatch.setattr(kernels, "_FAST_BACKENDS", dict(kernels._FAST_BACKENDS))
    monkeypatch.setattr(kernels, "_LOADERS", dict(kernels._LOADERS))
    monkeypatch.setattr(cuda, "_cupy", None)
    monkeypatch.setattr(cuda, "_failed", False)
    monkeypatch.delenv("GTOPK_KERNELS", raising=False)
    yield


def test_cuda_backend_is_registered_lazily():
    assert "cuda" in kernels._LOADERS or "cuda" in kernels._FAST_BACKENDS


def test_without_cupy_cuda_tensors_use_the_reference_after_one_warning(fresh_cuda_registry,
                                                                       monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cupy(name, *a, **kw):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    kernels.register_backend("cuda", loader=cuda.load)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert kernels.backend("cuda") == "reference"
        assert kernels._module(torch.device("cuda")) is reference
        assert kernels.backend("cuda:0") == "reference"
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "pip install gtopk-plugin[cuda]" in msgs[0]
    # forcing the CUDA back end now raises; CPU tensors are unaffected
    with pytest.raises(RuntimeError, match="forced"):
        kernels._module(torch.device("cuda"), "cuda")
    with pytest.raises(ValueError):
        kernels._module(torch.device("cpu"), "cuda")


def test_loader_that_succeeds_is_used(fresh_cuda_registry):
    import types

    fake = types.SimpleNamespace(select_topk=lambda x, o, k: "fast")
    calls = []

    def loader():
        calls.append(1)
        return fake

    kernels.register_backend("cuda", loader=loader)
    assert kernels.backend("cuda") == "cuda"
    assert kernels._module(torch.device("cuda")) is fake
    assert kernels._module(torch.device("cuda"), "reference") is reference
    assert len(calls) == 1


# Inputs of the reducer's fused and in-place kernels (compensate.cu, _cuda_fused.py);
# test_kernels_cpu.py uses _grads too.

def _grads(dtype, sizes, g, bad=()):
    """Separate gradient tensors (ties, -0.0, denormals where the dtype has
    them); NaN/Inf in the gradients listed in ``bad``."""
    out = []
    for t, n in enumerate(sizes):
        x = torch.randn(n, generator=g).to(dtype)
        if n > 50:
            x[10:30] = 0.5
            x[30:40] = -0.0
        if t in bad and n:
            x[n // 2] = float("nan") if t % 2 else -float("inf")
        out.append(x)
    return out


def _residual(dtype, n, g):
    r = (torch.randn(n, generator=g) * 0.5).to(dtype)
    r[::7] = 0.0
    return r


def _check_compensate_select(fn, grads, residual, offsets, k):
    """fn's compensate_select_topk against the reference: idx, vals, finite
    flags and every bit of acc."""
    N = sum(x.numel() for x in grads)
    dt = grads[0].dtype
    acc = torch.full((N,), 7.0, dtype=dt)
    ref_acc = acc.clone()
    got = fn(acc, grads, residual, offsets, k)
    ref = reference.compensate_select_topk(ref_acc, grads, residual, offsets, k)
    for a, b in zip(got, ref):
        assert_same(a, b)
    assert_same(acc, ref_acc)
    return got


def _cum_list(sizes):
    return [0] + np.cumsum(sizes).tolist()


# ---------------------------------------------------------------------------
# 4. Correctness of the kernels on a device: a GPU (skipped without one)
#    and the CPU executor (cuda_executor/), which runs the real csrc/cuda
#    kernels in CI
#
# On the executor the .cu files are compiled by g++ against its CUDA header
# and run block by block, threads as fibers, under race, barrier, warp-mask,
# bounds and uninitialized-shared-memory checks (any report fails the test);
# cuda.py's own host code drives them on CPU tensors (cuda_executor/gtopk.py),
# launches rotating through the forward, reverse and seeded random
# schedules.  Sizes are smaller there than on a GPU, still with several
# blocks per segment, candidate buffers and the sampled start.

def _cuda_ready():
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupy  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"CuPy is not importable ({e}); `pip install gtopk-plugin[cuda]`"
    return None


def _executor_ready():
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return "CPU EXECUTOR NOT RUN: g++ not found (apt-get install g++)"
    return None


_REASON = _cuda_ready()
_EX_REASON = _executor_ready()
DEVICES = [pytest.param("cuda", marks=pytest.mark.skipif(_REASON is not None, reason=str(_REASON))),
           pytest.param("executor", marks=pytest.mark.skipif(_EX_REASON is not None,
                                                             reason=str(_EX_REASON)))]


def on(device):
    """The torch device of a test device ("executor": CPU tensors)."""
    return "cpu" if device == "executor" else device


@pytest.fixture
def executor(monkeypatch, request):
    """cuda.py serving CPU tensors through the CPU executor (strict: any
    sanitizer report raises); the schedule seed differs per test."""
    from cuda_executor import Executor
    from cuda_executor.gtopk import install

    seed = int(hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:6], 16)
    ex = Executor(schedule="rotate", seed=seed)
    install(ex, monkeypatch.setattr)
    yield ex
    ex.reset()


@pytest.fixture(autouse=True)
def backend(request):
    """Device tests: the CUDA back end must load (compile) when CuPy is
    there; on the executor, the executor serving cuda.py (else None)."""
    cs = getattr(request.node, "callspec", None)
    dev = cs.params.get("device") if cs is not None else None
    if dev == "cuda":
        assert cuda.load() is not None, "CuPy imports but the CUDA kernels did not load"
    yield request.getfixturevalue("executor") if dev == "executor" else None


def bits(t):
    return t.view(INT_VIEW[t.dtype]) if t.dtype in INT_VIEW else t


def assert_same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        na, nb = torch.isnan(a), torch.isnan(b)
        assert torch.equal(na, nb)
        assert torch.equal(bits(a)[~na], bits(b)[~nb])
    else:
        assert torch.equal(a, b)


_OPMATH = {torch.float32: torch.float32, torch.float64: torch.float64,
           torch.float16: torch.float32, torch.bfloat16: torch.float32}


def div_as_cuda(v, divisor):
    """v / divisor as torch computes it on CUDA: times the reciprocal,
    rounded in the opmath type (the reference on CPU tensors divides)."""
    if divisor == 1:
        return v.clone()
    op = _OPMATH[v.dtype]
    inv = torch.tensor(1.0, dtype=op) / torch.tensor(float(divisor), dtype=op)
    return (v.to(op) * inv).to(v.dtype)


def _exact(divisor):
    return divisor & (divisor - 1) == 0  # a power of two: both divisions agree


def _mixed(dtype, n, g):
    x = torch.randn(n, generator=g).to(dtype)
    x[100:200] = 0.5
    x[200:260] = -0.5
    x[300:400] = 0.0
    x[400:420] = -0.0
    x[500] = float("nan")
    x[501] = float("inf")
    x[502] = -float("inf")
    if dtype in (torch.float32, torch.float64):
        x[600:604] = torch.tensor([1e-40, -1e-42, 1e-45, 3e-39], dtype=dtype)
    return x


def _cases(dtype, g):
    return _mixed(dtype, 70_000, g), [0, 0, 1, 3, 700, 1000, 20_000, 70_000]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_select_matches_reference_and_oracle(device, dtype):
    g = torch.Generator().manual_seed(5)
    x, offsets = _cases(dtype, g)
    xd = x.to(on(device))
    off = torch.tensor(offsets)
    for ks in ([0, 1, 1, 50, 300, 1900, 700], [5, 5, 2, 697, 1000, 1, 50_000],
               [3, 1, 3, 698, 301, 19_000, 49_999], [1, 1, 1, 1, 1, 1, 1], [0] * 7):
        k = torch.tensor(ks)
        got = cuda.select_topk(xd, off, k)
        assert got[0].device.type == xd.device.type and got[0].dtype == torch.int32
        assert_same(got[0], reference.select_topk(xd, off, k)[0])
        assert_same(got[1], reference.select_topk(xd, off, k)[1])
        np.testing.assert_array_equal(
            got[0].long().cpu().numpy(),
            topk_np(x, offsets, [max(0, min(kk, offsets[s + 1] - offsets[s])) for s, kk in enumerate(ks)]))
        th = cuda.select_threshold(xd, off, k)
        ref = reference.select_threshold(xd, off, k)
        assert_same(th[0], ref[0])
        assert_same(th[1], ref[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int64_index_kernels_match_reference(device, dtype, monkeypatch):
    """The int64-index kernels (buffers of more than 2^31 - 1 entries): the
    index width forced for every size, cuda.py and the reference alike."""
    monkeypatch.setattr(reference, "INT32_LIMIT", -1)
    g = torch.Generator().manual_seed(19)
    x = _mixed(dtype, 40_000, g).to(on(device))
    off = torch.tensor([0, 3, 700, 36_000, 40_000])  # the last segment: one whole sample
    for ks in ([1, 50, 3000, 40], [3, 697, 35_000, 3999]):
        k = torch.tensor(ks)
        for op in ("select_topk", "select_threshold"):
            got, ref = getattr(cuda, op)(x, off, k), getattr(reference, op)(x, off, k)
            assert got[0].dtype == torch.int64
            for a, b in zip(got, ref):
                assert_same(a, b)
    grads = [t.to(on(device)) for t in _grads(dtype, [700, 30_000], g, bad=(1,))]
    _check_compensate_select(cuda.compensate_select_topk, grads, None, torch.tensor([0, 30_700]),
                             torch.tensor([900]))


def _bound_probe(ex):
    """Counts the segments that start from their sampled bound (read from
    the segment state after each gtopk_bound_decide launch)."""
    seen = []

    def hook(name, args):
        if name == "gtopk_bound_decide":
            st = ex.tensor_at(args[3]).view(-1, cuda.ST_N)
            seen.append(int((st[:, 5] == 1).sum()))
    ex.on_launch = hook
    return seen


@pytest.mark.parametrize("device", DEVICES)
def test_select_large_and_heavy_ties(device, backend):
    g = torch.Generator().manual_seed(6)
    n = 3_000_000 if device == "cuda" else 120_000
    bound = _bound_probe(backend) if backend is not None else None
    for x in (torch.randn(n, generator=g), torch.zeros(n), torch.ones(n)):
        xd = x.to(on(device))
        for ks in ([n // 100], [1], [n - 1], [n]):
            off, k = torch.tensor([0, n]), torch.tensor(ks)
            assert_same(cuda.select_topk(xd, off, k)[0], reference.select_topk(xd, off, k)[0])
            assert_same(cuda.select_threshold(xd, off, k)[0],
                        reference.select_threshold(xd, off, k)[0])
    if bound is not None:
        assert sum(bound) > 0  # the sampled start was taken (random data)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("itype", [torch.int32, torch.int64])
def test_merge_matches_reference(device, dtype, itype):
    g = torch.Generator().manual_seed(7)
    offsets = torch.tensor([0, 500, 520, 3000, 100_000])
    k = torch.tensor([40, 0, 200, 1500])
    ia = torch.sort(torch.randperm(100_000, generator=g)[:9000]).values.to(itype)
    ib = torch.sort(torch.randperm(100_000, generator=g)[:7000]).values.to(itype)
    va = torch.randn(9000, generator=g).to(dtype)
    vb = torch.randn(7000, generator=g).to(dtype)
    va[:50], vb[:50] = -0.25, 0.25
    va[60], vb[61] = float("nan"), -0.0
    a = [t.to(on(device)) for t in (ia, va)]
    b = [t.to(on(device)) for t in (ib, vb)]
    got = cuda.merge_select(*a, *b, offsets, k)
    ref = reference.merge_select(*a, *b, offsets, k)
    for x, y in zip(got, ref):
        assert_same(x, y)
    swapped = cuda.merge_select(*b, *a, offsets, k)
    assert_same(swapped[0], got[0].to(swapped[0].dtype))
    assert_same(swapped[1], got[1])
    np.testing.assert_array_equal(got[0].long().cpu().numpy(),
                                  merge_np(ia, va.double(), ib, vb.double(), offsets.tolist(),
                                           k.tolist()) if dtype == torch.float64 else
                                  ref[0].long().cpu().numpy())
    for args in ((a[0][:0], a[1][:0], *b), (a[0][:10], a[1][:10], b[0][:0], b[1][:0])):
        for x, y in zip(cuda.merge_select(*args, offsets, k), reference.merge_select(*args, offsets, k)):
            assert_same(x, y)


def test_merge_host_paths(executor):
    """Unsorted operands go to the reference (after the bounds kernel);
    indices outside the segments raise."""
    g = torch.Generator().manual_seed(11)
    offsets, k = torch.tensor([0, 500, 3000]), torch.tensor([40, 200])
    ia = torch.sort(torch.randperm(3000, generator=g)[:900]).values
    ib = torch.sort(torch.randperm(3000, generator=g)[:700]).values
    va, vb = torch.randn(900, generator=g), torch.randn(700, generator=g)
    perm = torch.randperm(900, generator=g)
    n0 = len(executor.launches)
    got = cuda.merge_select(ia[perm], va[perm], ib, vb, offsets, k)
    for a, b in zip(got, reference.merge_select(ia[perm], va[perm], ib, vb, offsets, k)):
        assert_same(a, b)
    assert executor.launches[n0:] == ["gtopk_merge_bounds_i64"]
    with pytest.raises(RuntimeError, match="within"):
        cuda.merge_select(ia, va, ib, vb, torch.tensor([0, 500]), k[:1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divisor", [1, 3, 7])
def test_scatter_match_reference(device, dtype, divisor):
    g = torch.Generator().manual_seed(8)
    n = 100_000
    for itype in (torch.int32, torch.int64):
        idx = torch.sort(torch.randperm(n, generator=g)[:1000]).values.to(itype).to(on(device))
        vals = torch.randn(1000, generator=g).to(dtype).to(on(device))
        for i in (idx, idx.flip(0)):
            got = cuda.scatter_update(n, i, vals, divisor, dtype)
            if device == "cuda" or _exact(divisor):
                assert_same(got, reference.scatter_update(n, i, vals, divisor, dtype))
            else:
                want = torch.zeros(n, dtype=dtype)
                want[i.long()] = div_as_cuda(vals, divisor)
                assert_same(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_uses_cuda_kernels(device, backend, request):
    if device == "executor":  # the real loader, with the executor in CuPy's place
        import sys

        from cuda_executor.gtopk import cupy_module

        mp = request.getfixturevalue("monkeypatch")
        request.getfixturevalue("fresh_cuda_registry")
        mp.setitem(sys.modules, "cupy", cupy_module(backend))
        mp.setattr(torch.cuda, "current_device", lambda: 0)
        kernels.register_backend("cuda", loader=cuda.load)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert kernels.backend("cuda") == "cuda"
        assert kernels._module(torch.device("cuda")) is cuda and cuda._modules
        n0 = len(backend.launches)
        idx, vals = cuda.select_topk(torch.randn(10_000), torch.tensor([0, 10_000]), torch.tensor([100]))
        assert idx.numel() == 100 and "gtopk_topk_pass_f32_i32" in backend.launches[n0:]
        return
    assert kernels.backend(device) == "cuda"
    x = torch.randn(10_000, device=device)
    idx, vals = kernels.select_topk(x, torch.tensor([0, 10_000]), torch.tensor([100]))
    assert idx.device.type == "cuda" and idx.numel() == 100


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_compensation_matches_reference(device, dtype):
    """compensate and compensate_select_topk on the device against the
    reference on the same device: acc bit for bit, flags, the exact top-k
    (layer and global segments, sampled start taken and failed, NaN/Inf
    gradients)."""
    g = torch.Generator().manual_seed(17)
    big = 300_000 if device == "cuda" else 100_000
    sizes = [0, 3, 700, 20_000, big]
    N = sum(sizes)
    layer = torch.tensor(_cum_list(sizes))
    for bad, with_residual in (((), False), ((3,), True), ((1, 4), True)):
        grads = [x.to(on(device)) for x in _grads(dtype, sizes, g, bad=bad)]
        residual = _residual(dtype, N, g).to(on(device)) if with_residual else None
        for offsets, ks in ((layer, [1, 1, 50, 300, 3000]), (layer, [0, 3, 700, 1, big // 2]),
                            (torch.tensor([0, N]), [3200]), (torch.tensor([0, 5000]), [9])):
            k = torch.tensor(ks)
            acc = torch.full((N,), 7.0, dtype=dtype, device=on(device))
            ref_acc = acc.clone()
            got = cuda.compensate_select_topk(acc, grads, residual, offsets, k)
            ref = reference.compensate_select_topk(ref_acc, grads, residual, offsets, k)
            for a, b in zip(got, ref):
                assert_same(a, b)
            assert_same(acc, ref_acc)
            assert got[2].tolist() == [t not in bad for t in range(len(sizes))]
        for t, x in enumerate(grads):
            r = None if residual is None else residual[layer[t]:layer[t + 1]]
            out, ref_out = torch.empty_like(x), torch.empty_like(x)
            assert cuda.compensate(out, x, r) == reference.compensate(ref_out, x, r) == (t not in bad)
            assert_same(out, ref_out)
    n = 200_000 if device == "cuda" else 60_000
    zeros = [torch.zeros(n, dtype=dtype, device=on(device))]
    zeros[0][[5, 77, n // 2]] = torch.tensor([1.0, -2.0, 0.5], dtype=dtype, device=on(device))
    for ks in ([2], [3000]):  # heavy ties: the bound fails, the passes read acc
        acc, ref_acc = (torch.empty(n, dtype=dtype, device=on(device)) for _ in range(2))
        off, k = torch.tensor([0, n]), torch.tensor(ks)
        for a, b in zip(cuda.compensate_select_topk(acc, zeros, None, off, k),
                        reference.compensate_select_topk(ref_acc, zeros, None, off, k)):
            assert_same(a, b)


def test_compensate_host_paths(executor):
    """compensate: empty and tiny inputs, a 2-D non-contiguous gradient
    (flattened), a gradient of another dtype (the reference, no launch)."""
    g = torch.Generator().manual_seed(13)
    for n in (0, 3):
        grad = _grads(torch.float32, [n], g)[0]
        out, ref_out = torch.empty(n), torch.empty(n)
        assert cuda.compensate(out, grad, None) == reference.compensate(ref_out, grad, None)
        assert_same(out, ref_out)
    grad2 = torch.randn(40, 50, generator=g).t()
    out, ref_out = torch.empty(2000), torch.empty(2000)
    assert cuda.compensate(out, grad2, None) and reference.compensate(ref_out, grad2, None)
    assert_same(out, ref_out)
    n0 = len(executor.launches)
    out = torch.empty(10)
    assert cuda.compensate(out, torch.randn(10, dtype=torch.float64), None)
    assert len(executor.launches) == n0


def test_compensate_select_topk_host_paths(executor):
    """Heavy ties (the sampled bound fails: the passes read acc), 2-D
    gradients, segments that do not cover acc (unfused), mixed dtypes (the
    reference), a length mismatch (the reference's error)."""
    g = torch.Generator().manual_seed(15)
    zeros = [torch.zeros(40_000), torch.zeros(30_000)]
    zeros[0][[5, 17, 30_000]] = torch.tensor([1.0, -2.0, 0.5])
    off = torch.tensor([0, 40_000, 70_000])
    _check_compensate_select(cuda.compensate_select_topk, zeros, None, off, torch.tensor([100, 5]))
    mats = [torch.randn(100, 300, generator=g), torch.randn(50, generator=g)]
    _check_compensate_select(cuda.compensate_select_topk, mats, _residual(torch.float32, 30_050, g),
                             torch.tensor([0, 30_000, 30_050]), torch.tensor([300, 5]))
    before = executor.launches.count("gtopk_comp_collect_f32")
    _check_compensate_select(cuda.compensate_select_topk, mats, None, torch.tensor([0, 20_000]),
                             torch.tensor([50]))
    assert executor.launches.count("gtopk_comp_collect_f32") == before
    assert "gtopk_compensate_f32" in executor.launches
    with pytest.raises(ValueError, match="gradients hold"):
        cuda.compensate_select_topk(torch.empty(10), [torch.randn(9)], None, torch.tensor([0, 10]),
                                    torch.tensor([1]))
    mixed = [torch.randn(100, generator=g), torch.randn(50, generator=g).double()]
    n0 = len(executor.launches)
    acc = torch.empty(150)
    got = cuda.compensate_select_topk(acc, mixed, None, torch.tensor([0, 150]), torch.tensor([4]))
    ref = reference.compensate_select_topk(torch.empty(150), mixed, None, torch.tensor([0, 150]),
                                           torch.tensor([4]))
    assert len(executor.launches) == n0
    for a, b in zip(got, ref):
        assert_same(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divisor", [1, 3, 7])
def test_in_place_updates_match_reference(device, dtype, divisor):
    g = torch.Generator().manual_seed(18)
    n = 100_000
    base = torch.randn(n, generator=g).to(dtype)
    base[:5] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 0.5]).to(dtype)
    base[100:3000] = 0.0
    base = base.to(on(device))
    as_ref = device == "cuda" or _exact(divisor)  # else: CUDA's division on CPU tensors
    for itype in (torch.int32, torch.int64):
        idx = torch.sort(torch.randperm(n, generator=g)[:1000]).values.to(itype).to(on(device))
        sent = torch.randn(1000, generator=g).to(dtype).to(on(device))
        prev = torch.sort(torch.randperm(n, generator=g)[:800]).values.to(itype).to(on(device))
        prev[:100] = idx[:100]  # written by both results: the new value wins
        a, b = base.clone(), base.clone()
        assert cuda.subtract_at_(a, idx, sent) is a
        assert_same(a, reference.subtract_at_(b, idx, sent))
        for p in (prev, prev[:0]):
            a, b = base.clone(), base.clone()
            assert cuda.scatter_reset_(a, p, idx, sent, divisor) is a
            if as_ref:
                reference.scatter_reset_(b, p, idx, sent, divisor)
            else:
                b[p.long()] = 0
                b[idx.long()] = div_as_cuda(sent, divisor)
            assert_same(a, b)
    a, b = base.clone(), base.clone()
    got = cuda.div_count_(a, divisor)
    if as_ref:
        assert got == reference.div_count_(b, divisor)
    else:
        b = div_as_cuda(b, divisor)
        assert got == int(torch.count_nonzero(b))
    assert_same(a, b)
    assert cuda.div_count_(base[:0], divisor) == 0


def test_executor_serves_every_launched_kernel(executor):
    """Every kernel cuda.py may launch is in the module the executor built
    from its source (names found in the compiled code, parameter sizes
    checked at each launch)."""
    for f, names in cuda.kernel_names().items():
        for name in names:
            cuda._kernel(f, name)
