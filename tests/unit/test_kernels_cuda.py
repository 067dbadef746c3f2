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
3. **Correctness on a device** (parametrized over the devices present; skip
   with a reason where there is no GPU or no CuPy): every kernel against the
   reference on the same device, bit for bit, and the numpy oracles: ties,
   -0.0, NaN/Inf, denormals, k = 0, 1, n, n + 1, empty and tiny segments,
   segments large enough for candidate buffers and heavy ties.

Plus the dispatch: without CuPy, CUDA tensors use the reference after
exactly one warning naming ``pip install gtopk-plugin[cuda]``.
"""
import collections
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


# ---------------------------------------------------------------------------
# 3b. The host side of cuda.py against a numpy emulation of the kernels
#
# A fake CuPy whose kernels check their arguments against the PTX signature
# (count and sizes) and then run a numpy emulation of the kernel (written from
# the .cu code, at grid level: blocks, scans and tickets aside) on CPU
# tensors.  This runs every line of cuda.py's host code -- layouts, buffer
# sizes and offsets, argument order, launch sequence, sorting and cutting --
# and checks the results against the reference bit for bit.

_BITS = {torch.float32: np.uint32, torch.float64: np.uint64,
         torch.float16: np.uint16, torch.bfloat16: np.uint16}
_OPMATH = {torch.float32: torch.float32, torch.float64: torch.float64,
           torch.float16: torch.float32, torch.bfloat16: torch.float32}


class _Emu:
    def __init__(self, sig):
        self.sig = sig          # {name: [param sizes]} from the PTX
        self.reg = {}           # device pointer -> tensor
        self.launches = []
        self.bound_used = 0     # segments that started from a sampled bound

    # -- plumbing ----------------------------------------------------------
    def ptr(self, t):
        if t.numel():  # empty tensors may share an address; the kernels never read them
            self.reg[t.data_ptr()] = t
        return np.uint64(t.data_ptr())

    def T(self, p, dtype=None):
        if dtype is not None and (int(p) not in self.reg or self.reg[int(p)].numel() == 0):
            return torch.empty(0, dtype=dtype)
        return self.reg[int(p)]

    def call(self, name, grid, block, args):
        assert block == (cuda.THREADS,) and len(grid) == 1 and grid[0] >= 1, (name, grid, block)
        sizes = self.sig[name]
        assert len(args) == len(sizes), f"{name}: {len(args)} arguments for {len(sizes)} parameters"
        for a, n in zip(args, sizes):
            assert isinstance(a, (np.int32, np.int64, np.uint64)) and a.itemsize == n, (name, args, sizes)
        self.launches.append(name)
        base = re.sub(r"_(f32|f64|f16|bf16)|_(i32|i64)", "", name)
        getattr(self, base[len("gtopk_"):])(*args)

    # -- select.cu / radix.cuh -------------------------------------------------
    def radix_init(self, seg, k, S, st):
        seg, k, st = self.T(seg).numpy(), self.T(k).numpy(), self.T(st).numpy()
        for s in range(int(S)):
            n = seg[s + 1] - seg[s]
            r = min(k[s], n)
            st[s * 8:(s + 1) * 8] = [max(r, 0), 0, 0, 0, (2**63 - 1) if r > 0 else -1, 0, 0, 0]

    def _radix(self, load, lay, seg_end, S, j, kbits, wbits, st, hist, ctr, cand0, cand1, out):
        S, j, kbits, wbits = int(S), int(j), int(kbits), int(wbits)
        L = self.T(lay).numpy()
        seg, blk, cap, outo = (L[i * (S + 1):(i + 1) * (S + 1)] for i in range(4))
        send_all = self.T(seg_end).numpy()
        stn = self.T(st).numpy()
        H = self.T(hist).numpy().view(np.uint64)
        C = self.T(ctr).numpy().view(np.uint64)
        c0, c1, o = self.T(cand0).numpy(), self.T(cand1).numpy(), self.T(out).numpy()
        npass = cuda._passes(kbits, wbits)
        for s in range(S):
            if blk[s + 1] == blk[s]:
                continue
            sts = stn[s * 8:(s + 1) * 8]
            FIN = sts[4]
            if FIN < j:
                continue
            fin = FIN == j
            if not fin and j >= npass:
                continue
            B, KP, IP = np.uint64(sts[3]), np.uint64(sts[1]), np.uint64(sts[2])
            from_cand = sts[5] != 0
            to_cand = (not fin) and j > 0 and sts[7] != 0
            lo = seg[s]
            nitems = sts[6] if from_cand else seg[s + 1] - lo
            assert nitems <= (blk[s + 1] - blk[s]) * cuda.CHUNK
            SRC = sts[5]
            cin = c1 if SRC == 2 else c0
            cout = c1 if SRC == 1 else c0
            cbase, ccap = cap[s], cap[s + 1] - cap[s]
            pos = cin[cbase:cbase + nitems].copy() if from_cand else lo + np.arange(nitems)
            valid, key, inv = load(pos, send_all[s + 1])
            pos, key, inv = pos[valid], key[valid], inv[valid]
            em = np.zeros(pos.size, bool)
            sv = np.ones(pos.size, bool)
            if j > 0:
                word, sh, w = pass_spec(j - 1, kbits, wbits)
                if word == 0:
                    match = (key >> np.uint64(sh + w)) == KP
                else:
                    match = (key == KP) & ((inv >> np.uint64(sh + w)) == IP)
                d = ((inv if word else key) >> np.uint64(sh)) & np.uint64((1 << w) - 1)
                em = match & ((d > B) | (fin & (d == B)))
                sv = match & (d == B)
            if fin:
                sv[:] = False
            ocap = outo[s + 1] - outo[s]
            slots = int(C[S + s]) + np.arange(int(em.sum()))
            o[outo[s] + slots[slots < ocap]] = pos[em][slots < ocap]
            C[S + s] += np.uint64(em.sum())
            if to_cand:
                q = int(C[2 * S + s]) + np.arange(int(sv.sum()))
                cout[cbase + q[q < ccap]] = pos[sv][q < ccap]
                C[2 * S + s] += np.uint64(sv.sum())
            if fin:
                continue
            word2, sh2, w2 = pass_spec(j, kbits, wbits)
            dig = ((inv[sv] if word2 else key[sv]) >> np.uint64(sh2)) & np.uint64((1 << w2) - 1)
            H[s * cuda.BINS:(s + 1) * cuda.BINS] += np.bincount(
                dig.astype(np.int64), minlength=cuda.BINS).astype(np.uint64)
            # the segment's last block
            h = H[s * cuda.BINS:(s + 1) * cuda.BINS].astype(np.int64)
            H[s * cuda.BINS:(s + 1) * cuda.BINS] = 0
            total = int(h.sum())
            r = int(sts[0])
            if j == 0:
                r = min(r, total)
            b = None
            if r > 0:
                cum = 0
                for bb in range(cuda.BINS - 1, -1, -1):
                    if cum + h[bb] >= r:
                        b = bb
                        break
                    cum += h[bb]
            if b is None:
                sts[4] = -1
            else:
                if j > 0:
                    word, sh, w = pass_spec(j - 1, kbits, wbits)
                    if word == 0:
                        sts[1] = int((int(KP) << w) | int(B))
                    else:
                        sts[2] = int((int(IP) << w) | int(B))
                hb, rem = int(h[b]), r - cum
                if to_cand:
                    sts[5], sts[6] = (2 if SRC == 1 else 1), total
                sts[3], sts[0] = b, rem
                if rem == hb:
                    sts[4] = j + 1
                else:
                    sts[7] = int(hb <= ccap)
            C[s] = 0
            C[2 * S + s] = 0

    def topk_pass(self, x, lay, S, j, kbits, wbits, st, hist, ctr, cand0, cand1, out):
        keys = keys_np(self.T(x))

        def load(pos, send):
            return np.ones(pos.size, bool), keys[pos], (send - 1 - pos).astype(np.uint64)

        self._radix(load, lay, lay, S, j, kbits, wbits, st, hist, ctr, cand0, cand1, out)

    def thr_sample(self, x, seg, tpar, thr):
        self._sample(keys_np(self.T(x)), seg, tpar, thr)

    def _sample(self, keys, seg, tpar, thr):
        seg, tpar, thr = self.T(seg).numpy(), self.T(tpar).numpy(), self.T(thr).numpy().view(np.uint64)
        for s in range(tpar.size):
            ks = tpar[s]
            if ks <= 0:
                thr[s] = 0 if ks == 0 else 2**64 - 1
                continue
            lo, n = seg[s], seg[s + 1] - seg[s]
            p = np.arange(min(n, cuda.KERNEL_SAMPLE))
            if n > cuda.KERNEL_SAMPLE:
                p = (p // cuda.KERNEL_RUN) * (n // (cuda.KERNEL_SAMPLE // cuda.KERNEL_RUN)) + p % cuda.KERNEL_RUN
            samp = np.concatenate([keys[lo + p], np.zeros(cuda.KERNEL_SAMPLE - p.size, np.uint64)])
            thr[s] = np.sort(samp)[::-1][ks - 1]

    def _collect_ge(self, x, lay, S, thr, ctr, out, which):
        keys = keys_np(self.T(x))
        S = int(S)
        L = self.T(lay).numpy()
        seg, outo = L[:S + 1], L[which * (S + 1):(which + 1) * (S + 1)]
        thr = self.T(thr).numpy().view(np.uint64)
        # counters: output slots ctr[S, 2S) (which = 3), candidate slots ctr[2S, 3S) (which = 2)
        C = self.T(ctr).numpy().view(np.uint64)[(S if which == 3 else 2 * S):]
        o = self.T(out).numpy()
        for s in range(S):
            if thr[s] == np.uint64(2**64 - 1):
                continue
            ge = seg[s] + np.flatnonzero(keys[seg[s]:seg[s + 1]] >= thr[s])
            slots = int(C[s]) + np.arange(ge.size)
            ocap = outo[s + 1] - outo[s]
            o[outo[s] + slots[slots < ocap]] = ge[slots < ocap]
            C[s] += np.uint64(ge.size)

    def thr_count(self, x, lay, S, thr, ctr, out):
        self._collect_ge(x, lay, S, thr, ctr, out, 3)

    def bound_collect(self, x, lay, S, thr, ctr, cand0):
        self._collect_ge(x, lay, S, thr, ctr, cand0, 2)

    def bound_decide(self, lay, S, ctr, st):
        S = int(S)
        L = self.T(lay).numpy()
        cap = L[2 * (S + 1):3 * (S + 1)]
        C, stn = self.T(ctr).numpy().view(np.uint64), self.T(st).numpy()
        for s in range(S):
            cnt = int(C[2 * S + s])
            p = stn[s * 8:(s + 1) * 8]
            if p[4] != -1 and cnt >= p[0] and cnt > 0 and cnt <= cap[s + 1] - cap[s]:
                p[5], p[6] = 1, cnt
                self.bound_used += 1
            C[2 * S + s] = 0

    def thr_decide(self, seg, k, cpar, S, ctr, st):
        seg, k, cpar = self.T(seg).numpy(), self.T(k).numpy(), self.T(cpar).numpy()
        C, stn = self.T(ctr).numpy().view(np.uint64), self.T(st).numpy()
        S = int(S)
        for s in range(S):
            cnt = int(C[S + s])
            n = seg[s + 1] - seg[s]
            r0 = min(k[s], n)
            keep = (cpar[2 * s] <= cnt <= cpar[2 * s + 1]) or r0 <= 0
            stn[s * 8:(s + 1) * 8] = [0 if keep else r0, 0, 0, 0, -1 if keep else 2**63 - 1, 0, 0, 0]
            if not keep:
                C[S + s] = 0

    def thr_clear(self, outo, S, st, out):
        outo, stn, o = self.T(outo).numpy(), self.T(st).numpy(), self.T(out)
        for s in range(int(S)):
            if stn[s * 8 + 4] != -1:
                o[outo[s]:outo[s + 1]] = torch.iinfo(o.dtype).max

    # -- compensate.cu -------------------------------------------------------
    def _opt(self, p):
        return None if int(p) == 0 else self.T(p)

    @staticmethod
    def _comp(g, r):
        if r is None:
            return g.clone()
        op = _OPMATH[g.dtype]
        return (g.to(op) + r.to(op)).to(g.dtype)

    def compensate(self, g, r, n, out, bad):
        n, g, r = int(n), self.T(g), self._opt(r)
        self.T(out)[:n] = self._comp(g[:n], None if r is None else r[:n])
        if not bool(torch.isfinite(g[:n]).all()):
            self.T(bad)[0] = 1

    def _grads(self, gptr, goff, T):
        off = self.T(goff).tolist()
        ptrs = self.T(gptr).tolist()
        assert len(ptrs) == int(T) and len(off) == int(T) + 1
        return [self.T(p)[:off[t + 1] - off[t]] if off[t + 1] > off[t] else None
                for t, p in enumerate(ptrs)], off

    def _compensated(self, gptr, goff, T, r):
        grads, off = self._grads(gptr, goff, T)
        r = self._opt(r)
        parts = [self._comp(g, None if r is None else r[off[t]:off[t + 1]])
                 for t, g in enumerate(grads) if g is not None]
        return torch.cat(parts), grads

    def comp_sample(self, gptr, goff, T, r, seg, tpar, thr):
        acc, _ = self._compensated(gptr, goff, T, r)
        self._sample(keys_np(acc), seg, tpar, thr)

    def comp_collect(self, gptr, goff, T, r, acc, lay, S, thr, ctr, cand0, bad):
        vals, grads = self._compensated(gptr, goff, T, r)
        a = self.T(acc)
        assert a.numel() == vals.numel() == self.T(lay)[int(S)]  # the segments cover acc
        a.copy_(vals)
        b = self.T(bad)
        for t, g in enumerate(grads):
            if g is not None and not bool(torch.isfinite(g).all()):
                b[t] = 1
        if int(thr) != 0:
            self._collect_ge(acc, lay, S, thr, ctr, cand0, 2)

    def subtract_at(self, acc, idx, sent, n, numel):
        a, i, v = self.T(acc), self.T(idx).long()[:int(n)], self.T(sent)[:int(n)]
        op = _OPMATH[a.dtype]
        a[i] = (a[i].to(op) - v.to(op)).to(a.dtype)

    def zero_at(self, idx, n, out, numel):
        self.T(out)[self.T(idx).long()[:int(n)]] = 0

    def div_count(self, x, y, n, divisor, count):
        x, y = self.T(x)[:int(n)], self.T(y)[:int(n)]
        y.copy_(self._divide(x, int(divisor)))
        self.T(count)[0] += int((keys_np(y) != 0).sum())

    # -- merge.cu ------------------------------------------------------------
    def merge_bounds(self, ia, na, ib, nb, offsets, S, bnd):
        off = self.T(offsets).numpy()
        a = self.T(ia, torch.int64).numpy()[:int(na)]
        b = self.T(ib, torch.int64).numpy()[:int(nb)]
        self.T(bnd).numpy()[:] = np.concatenate([np.searchsorted(a, off), np.searchsorted(b, off)])

    def merge_union(self, ia, va, na, ib, vb, nb, bnd, S, uidx, uval, uvalid, posa, posb):
        na, nb, S = int(na), int(nb), int(S)
        a = self.T(ia, torch.int64).numpy()[:na].astype(np.int64)
        b = self.T(ib, torch.int64).numpy()[:nb].astype(np.int64)
        vdt = self.T(uval).dtype
        va, vb = self.T(va, vdt)[:na], self.T(vb, vdt)[:nb]
        bd = self.T(bnd).numpy()
        ab, bb = bd[:S + 1], bd[S + 1:]
        ui, uv, ok = self.T(uidx).numpy(), self.T(uval), self.T(uvalid).numpy()
        pa, pb = self.T(posa).numpy(), self.T(posb).numpy()
        i = np.arange(na)
        sa = np.searchsorted(ab, i, side="right") - 1
        p = i + bb[sa]
        j = np.searchsorted(b, a)
        dup = (j < nb) & (b[np.minimum(j, max(nb - 1, 0))] == a) if nb else np.zeros(na, bool)
        s_ = torch.zeros(na, dtype=va.dtype) + va
        if dup.any():
            jj = torch.from_numpy(j[dup])
            s_[torch.from_numpy(dup)] = s_[torch.from_numpy(dup)] + vb[jj]
        ui[p], ok[p], pa[:na] = a, 1, p
        uv[torch.from_numpy(p)] = s_
        jb = np.arange(nb)
        sb = np.searchsorted(bb, jb, side="right") - 1
        q = ab[sb + 1] + jb
        ii = np.searchsorted(a, b)
        dupb = (ii < na) & (a[np.minimum(ii, max(na - 1, 0))] == b) if na else np.zeros(nb, bool)
        ui[q], ok[q] = b, (~dupb).astype(np.uint8)
        uv[torch.from_numpy(q)] = torch.zeros(nb, dtype=vb.dtype) + vb
        pb[:nb] = np.where(dupb, ii + bb[sb], q)

    def merge_pass(self, uval, uidx, uvalid, lay, offsets, S, j, kbits, wbits, st, hist, ctr,
                   cand0, cand1, out):
        keys = keys_np(self.T(uval))
        ui, ok = self.T(uidx).numpy(), self.T(uvalid).numpy()

        def load(pos, send):
            return ok[pos] != 0, keys[pos], (send - 1 - ui[pos]).astype(np.uint64)

        self._radix(load, lay, offsets, S, j, kbits, wbits, st, hist, ctr, cand0, cand1, out)

    def merge_finish(self, slots, nslots, uidx, uval, sel, oidx, oval):
        n = int(nslots)
        sl = self.T(slots).numpy()[:n]
        used = sl != 2**63 - 1
        oi, ov = self.T(oidx), self.T(oval)
        self.T(sel).numpy()[sl[used]] = 1
        oi[:n] = torch.iinfo(oi.dtype).max
        oi[torch.from_numpy(np.flatnonzero(used))] = torch.from_numpy(
            self.T(uidx).numpy()[sl[used]]).to(oi.dtype)
        ov[:n] = 0
        ov[torch.from_numpy(np.flatnonzero(used))] = self.T(uval)[torch.from_numpy(sl[used])]

    def merge_keep(self, posa, na, posb, nb, sel, keep_a, keep_b):
        sel = self.T(sel).numpy()
        if int(na):
            self.T(keep_a).numpy()[:] = sel[self.T(posa).numpy()[:int(na)]]
        if int(nb):
            self.T(keep_b).numpy()[:] = sel[self.T(posb).numpy()[:int(nb)]]

    # -- scatter.cu ----------------------------------------------------------
    @staticmethod
    def _divide(v, divisor):
        if divisor == 1:
            return v
        op = _OPMATH[v.dtype]
        inv = torch.tensor(1.0, dtype=op) / torch.tensor(float(divisor), dtype=op)
        return (v.to(op) * inv).to(v.dtype)

    def scatter(self, idx, v, n, divisor, out, numel):
        i = self.T(idx).long()
        self.T(out)[i] = self._divide(self.T(v), int(divisor))


class _FakeKernel:
    def __init__(self, emu, name):
        self.emu, self.name = emu, name

    def __call__(self, grid, block, args):
        self.emu.call(self.name, grid, block, args)


class _FakeModule:
    def __init__(self, emu):
        self.emu = emu

    def get_function(self, name):
        assert name in self.emu.sig, f"no kernel {name} in the compiled code"
        return _FakeKernel(self.emu, name)


class _NoStream:
    def __init__(self, device):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def emulated(monkeypatch, nvrtc_ptx):
    """cuda.py serving CPU tensors through the emulated kernels."""
    emu = _Emu(nvrtc_ptx)
    monkeypatch.setattr(cuda, "_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(cuda, "_cupy", object())
    monkeypatch.setattr(cuda, "_modules", {f: _FakeModule(emu) for f in cuda.FILES})
    monkeypatch.setattr(cuda, "_kernels", {})
    monkeypatch.setattr(cuda, "_layouts", collections.OrderedDict())
    monkeypatch.setattr(cuda, "_On", _NoStream)
    monkeypatch.setattr(cuda, "_p", emu.ptr)
    return emu


def _assert_same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype.is_floating_point:
        na, nb = torch.isnan(a), torch.isnan(b)
        assert torch.equal(na, nb)
        assert torch.equal(a.view(INT_VIEW[a.dtype])[~na], b.view(INT_VIEW[b.dtype])[~nb])
    else:
        assert torch.equal(a, b)


def _mixed(dtype, n, g):
    x = torch.randn(n, generator=g).to(dtype)
    x[100:200] = 0.5
    x[200:260] = -0.5
    x[300:400] = 0.0
    x[400:420] = -0.0
    x[500] = float("nan")
    x[501] = float("inf")
    x[502] = -float("inf")
    return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_side_select_against_emulated_kernels(emulated, dtype):
    g = torch.Generator().manual_seed(9)
    n = 60_000
    x = _mixed(dtype, n, g)
    offsets = torch.tensor([0, 0, 1, 3, 700, 1000, 20_000, 60_000])
    for ks in ([0, 1, 1, 50, 300, 1900, 700], [5, 5, 2, 697, 1000, 1, 30_000],
               [3, 1, 3, 698, 301, 19_000, 39_999], [1] * 7, [0] * 7):
        k = torch.tensor(ks)
        for op in ("select_topk", "select_threshold"):
            got, ref = getattr(cuda, op)(x, offsets, k), getattr(reference, op)(x, offsets, k)
            for a, b in zip(got, ref):
                _assert_same_bits(a, b)
    assert "gtopk_topk_pass_" + cuda._VALUES[dtype][0] + "_i32" in emulated.launches
    assert any(n.startswith("gtopk_thr_count") for n in emulated.launches)


def test_host_side_select_large_and_heavy_ties(emulated):
    g = torch.Generator().manual_seed(10)
    n = 300_000
    z = torch.zeros(n)
    z[[5, 77, 100_000]] = torch.tensor([1.0, -2.0, 0.5])
    for x in (torch.randn(n, generator=g), z):
        offsets = torch.tensor([0, 100_000, n])
        for ks in ([2000, 3000], [1, 199_999], [100_000, 1], [40_000, 90_000]):
            k = torch.tensor(ks)
            for op in ("select_topk", "select_threshold"):
                got, ref = getattr(cuda, op)(x, offsets, k), getattr(reference, op)(x, offsets, k)
                for a, b in zip(got, ref):
                    _assert_same_bits(a, b)
    assert emulated.bound_used > 0  # the sampled start was taken (random data)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("itype", [torch.int32, torch.int64])
def test_host_side_merge_against_emulated_kernels(emulated, dtype, itype):
    g = torch.Generator().manual_seed(11)
    offsets = torch.tensor([0, 500, 520, 3000, 100_000])
    k = torch.tensor([40, 0, 200, 1500])
    ia = torch.sort(torch.randperm(100_000, generator=g)[:9000]).values.to(itype)
    ib = torch.sort(torch.randperm(100_000, generator=g)[:7000]).values.to(itype)
    va = torch.randn(9000, generator=g).to(dtype)
    vb = torch.randn(7000, generator=g).to(dtype)
    va[:50], vb[:50], va[60], vb[61] = -0.25, 0.25, float("nan"), -0.0
    for args in ((ia, va, ib, vb), (ib, vb, ia, va), (ia[:0], va[:0], ib, vb),
                 (ia[:10], va[:10], ib[:0], vb[:0])):
        got = cuda.merge_select(*args, offsets, k)
        ref = reference.merge_select(*args, offsets, k)
        for a, b in zip(got, ref):
            _assert_same_bits(a, b)
    # unsorted operands go to the reference
    perm = torch.randperm(9000, generator=g)
    got = cuda.merge_select(ia[perm], va[perm], ib, vb, offsets, k)
    for a, b in zip(got, reference.merge_select(ia[perm], va[perm], ib, vb, offsets, k)):
        _assert_same_bits(a, b)
    with pytest.raises(RuntimeError, match="within"):
        cuda.merge_select(ia, va, ib, vb, torch.tensor([0, 500, 520, 3000]), k[:3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divisor", [1, 2, 4])
def test_host_side_scatter_against_emulated_kernels(emulated, dtype, divisor):
    """Divisors whose reciprocal is exact: there the kernels' multiplication
    equals the CPU reference's division (other divisors match torch on CUDA,
    which multiplies by the reciprocal too: checked on a GPU)."""
    g = torch.Generator().manual_seed(12)
    n = 50_000
    for itype in (torch.int32, torch.int64):
        idx = torch.sort(torch.randperm(n, generator=g)[:700]).values.to(itype)
        vals = torch.randn(700, generator=g).to(dtype)
        _assert_same_bits(cuda.scatter_update(n, idx, vals, divisor, dtype),
                          reference.scatter_update(n, idx, vals, divisor, dtype))
        _assert_same_bits(cuda.scatter_update(n, idx.flip(0), vals, divisor, dtype),
                          reference.scatter_update(n, idx.flip(0), vals, divisor, dtype))


# The reducer's fused and in-place kernels (compensate.cu, _cuda_fused.py)

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


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_side_compensate_against_emulated_kernels(emulated, dtype):
    g = torch.Generator().manual_seed(13)
    for n, bad in ((5000, False), (3, False), (20_001, True), (0, False)):
        grad = _grads(dtype, [n], g, bad=(0,) if bad else ())[0]
        for r in (None, _residual(dtype, n, g)):
            out, ref_out = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            assert cuda.compensate(out, grad, r) == reference.compensate(ref_out, grad, r) == (not bad)
            assert_same(out, ref_out)
    # a 2-D gradient is flattened; another dtype goes to the reference
    grad2 = torch.randn(40, 50, generator=g).to(dtype).t()
    out, ref_out = torch.empty(2000, dtype=dtype), torch.empty(2000, dtype=dtype)
    assert cuda.compensate(out, grad2, None) and reference.compensate(ref_out, grad2, None)
    assert_same(out, ref_out)
    assert "gtopk_compensate_" + cuda._VALUES[dtype][0] in emulated.launches
    if dtype != torch.float64:
        n0 = len(emulated.launches)
        out = torch.empty(10, dtype=dtype)
        assert cuda.compensate(out, torch.randn(10, dtype=torch.float64), None)
        assert len(emulated.launches) == n0


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_side_compensate_select_topk_against_emulated_kernels(emulated, dtype):
    g = torch.Generator().manual_seed(14)
    sizes = [0, 3, 700, 20_000, 60_000]
    N = sum(sizes)
    layer = torch.tensor(_cum_list(sizes))
    whole = torch.tensor([0, N])
    cases = [(layer, [1, 1, 50, 300, 1900]), (layer, [0, 3, 700, 1, 30_000]),
             (layer, [0, 0, 0, 0, 0]), (whole, [80]), (whole, [8000]),
             (torch.tensor([0, 700, 50_000, N]), [7, 0, 30_000])]
    for bad, with_residual in (((), False), ((3,), True), ((1, 4), True)):
        grads = _grads(dtype, sizes, g, bad=bad)
        residual = _residual(dtype, N, g) if with_residual else None
        for offsets, ks in cases:
            got = _check_compensate_select(cuda.compensate_select_topk, grads, residual,
                                           offsets, torch.tensor(ks))
            assert got[2].tolist() == [t not in bad for t in range(len(sizes))]
    vs = cuda._VALUES[dtype][0]
    assert f"gtopk_comp_collect_{vs}" in emulated.launches
    assert f"gtopk_comp_sample_{vs}" in emulated.launches
    assert emulated.bound_used > 0  # the fused pass fed the radix select's candidates


def test_host_side_compensate_select_topk_paths(emulated):
    """Heavy ties (the sampled bound fails: the passes read acc), 2-D
    gradients, segments that do not cover acc (unfused), mixed dtypes (the
    reference), a length mismatch (the reference's error)."""
    g = torch.Generator().manual_seed(15)
    zeros = [torch.zeros(40_000), torch.zeros(30_000)]
    zeros[0][[5, 17, 30_000]] = torch.tensor([1.0, -2.0, 0.5])
    off = torch.tensor([0, 40_000, 70_000])
    _check_compensate_select(cuda.compensate_select_topk, zeros, None, off, torch.tensor([100, 5]))
    _check_compensate_select(cuda.compensate_select_topk, zeros, None, torch.tensor([0, 70_000]),
                             torch.tensor([3000]))
    mats = [torch.randn(100, 300, generator=g), torch.randn(50, generator=g)]
    _check_compensate_select(cuda.compensate_select_topk, mats, _residual(torch.float32, 30_050, g),
                             torch.tensor([0, 30_000, 30_050]), torch.tensor([300, 5]))
    before = emulated.launches.count("gtopk_comp_collect_f32")
    _check_compensate_select(cuda.compensate_select_topk, mats, None, torch.tensor([0, 20_000]),
                             torch.tensor([50]))
    assert emulated.launches.count("gtopk_comp_collect_f32") == before
    assert "gtopk_compensate_f32" in emulated.launches
    with pytest.raises(ValueError, match="gradients hold"):
        cuda.compensate_select_topk(torch.empty(10), [torch.randn(9)], None, torch.tensor([0, 10]),
                                    torch.tensor([1]))
    mixed = [torch.randn(100, generator=g), torch.randn(50, generator=g).double()]
    n0 = len(emulated.launches)
    _check_compensate_select(cuda.compensate_select_topk, mixed[:1], None, torch.tensor([0, 100]),
                             torch.tensor([3]))
    assert len(emulated.launches) > n0
    n0 = len(emulated.launches)
    acc = torch.empty(150)
    got = cuda.compensate_select_topk(acc, mixed, None, torch.tensor([0, 150]), torch.tensor([4]))
    ref = reference.compensate_select_topk(torch.empty(150), mixed, None, torch.tensor([0, 150]),
                                           torch.tensor([4]))
    assert len(emulated.launches) == n0
    for a, b in zip(got, ref):
        assert_same(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divisor", [1, 2, 4])
def test_host_side_in_place_updates_against_emulated_kernels(emulated, dtype, divisor):
    """subtract_at_, scatter_reset_ and div_count_ (exact reciprocals, as
    for scatter_update above: other divisors are a GPU check)."""
    g = torch.Generator().manual_seed(16)
    n = 30_000
    for itype in (torch.int32, torch.int64):
        base = torch.randn(n, generator=g).to(dtype)
        base[:5] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 0.5]).to(dtype)
        idx = torch.sort(torch.randperm(n, generator=g)[:900]).values.to(itype)
        sent = torch.randn(900, generator=g).to(dtype)
        a, b = base.clone(), base.clone()
        assert cuda.subtract_at_(a, idx, sent) is a
        assert_same(a, reference.subtract_at_(b, idx, sent))
        prev = torch.sort(torch.randperm(n, generator=g)[:700]).values.to(itype)
        prev[:100] = idx[:100]  # written by both results: the new value wins
        for p in (prev, prev[:0]):
            a, b = base.clone(), base.clone()
            assert cuda.scatter_reset_(a, p, idx, sent, divisor) is a
            assert_same(a, reference.scatter_reset_(b, p, idx, sent, divisor))
        a, b = base.clone(), base.clone()
        a[100:3000] = 0.0
        b[100:3000] = 0.0
        assert cuda.div_count_(a, divisor) == reference.div_count_(b, divisor)
        assert_same(a, b)
    vs = cuda._VALUES[dtype][0]
    for name in (f"gtopk_subtract_at_{vs}_i32", f"gtopk_zero_at_{vs}_i64", f"gtopk_div_count_{vs}"):
        assert name in emulated.launches
    assert cuda.div_count_(torch.empty(0, dtype=dtype), divisor) == 0


# ---------------------------------------------------------------------------
# 4. Correctness on a GPU (device-parametrized; skipped here without one)

def _cuda_ready():
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupy  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"CuPy is not importable ({e}); `pip install gtopk-plugin[cuda]`"
    return None


_REASON = _cuda_ready()
DEVICES = [pytest.param("cuda", marks=pytest.mark.skipif(_REASON is not None,
                                                         reason=str(_REASON)))]


@pytest.fixture(autouse=True)
def _cuda_backend_loaded(request):
    """GPU tests: the CUDA back end must load (compile) when CuPy is there."""
    cs = getattr(request.node, "callspec", None)
    if cs is not None and cs.params.get("device") == "cuda":
        assert cuda.load() is not None, "CuPy imports but the CUDA kernels did not load"
    yield


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


def _cases(dtype, g):
    x = torch.randn(70_000, generator=g).to(dtype)
    x[100:200] = 0.5
    x[200:260] = -0.5
    x[300:400] = 0.0
    x[400:420] = -0.0
    x[500] = float("nan")
    x[501] = float("inf")
    x[502] = -float("inf")
    if dtype in (torch.float32, torch.float64):
        x[600:604] = torch.tensor([1e-40, -1e-42, 1e-45, 3e-39], dtype=dtype)
    offsets = [0, 0, 1, 3, 700, 1000, 20_000, 70_000]
    return x, offsets


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_select_matches_reference_and_oracle(device, dtype):
    g = torch.Generator().manual_seed(5)
    x, offsets = _cases(dtype, g)
    xd = x.to(device)
    off = torch.tensor(offsets)
    for ks in ([0, 1, 1, 50, 300, 1900, 700], [5, 5, 2, 697, 1000, 1, 50_000],
               [3, 1, 3, 698, 301, 19_000, 49_999], [1, 1, 1, 1, 1, 1, 1]):
        k = torch.tensor(ks)
        got = cuda.select_topk(xd, off, k)
        assert got[0].device.type == "cuda" and got[0].dtype == torch.int32
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
def test_select_large_and_heavy_ties(device):
    g = torch.Generator().manual_seed(6)
    n = 3_000_000
    for x in (torch.randn(n, generator=g), torch.zeros(n), torch.ones(n)):
        xd = x.to(device)
        for ks in ([30_000], [1], [n - 1], [n]):
            off, k = torch.tensor([0, n]), torch.tensor(ks)
            assert_same(cuda.select_topk(xd, off, k)[0], reference.select_topk(xd, off, k)[0])
            assert_same(cuda.select_threshold(xd, off, k)[0],
                        reference.select_threshold(xd, off, k)[0])


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
    va[60] = float("nan")
    a = [t.to(device) for t in (ia, va)]
    b = [t.to(device) for t in (ib, vb)]
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divisor", [1, 3, 7])
def test_scatter_match_reference(device, dtype, divisor):
    g = torch.Generator().manual_seed(8)
    n = 100_000
    idx = torch.sort(torch.randperm(n, generator=g)[:1000]).values.to(torch.int32).to(device)
    vals = torch.randn(1000, generator=g).to(dtype).to(device)
    assert_same(cuda.scatter_update(n, idx, vals, divisor, dtype),
                reference.scatter_update(n, idx, vals, divisor, dtype))
    assert_same(cuda.scatter_update(n, idx.flip(0), vals, divisor, dtype),
                reference.scatter_update(n, idx.flip(0), vals, divisor, dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_uses_cuda_kernels(device):
    assert kernels.backend(device) == "cuda"
    x = torch.randn(10_000, device=device)
    idx, vals = kernels.select_topk(x, torch.tensor([0, 10_000]), torch.tensor([100]))
    assert idx.device.type == "cuda" and idx.numel() == 100


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_compensation_matches_reference(device, dtype):
    """compensate and compensate_select_topk on the GPU against the reference
    on the same GPU: acc bit for bit, flags, the exact top-k (layer and
    global segments, sampled start taken and failed, NaN/Inf gradients)."""
    g = torch.Generator().manual_seed(17)
    sizes = [0, 3, 700, 20_000, 300_000]
    N = sum(sizes)
    layer = torch.tensor(_cum_list(sizes))
    for bad, with_residual in (((), False), ((3,), True), ((1, 4), True)):
        grads = [x.to(device) for x in _grads(dtype, sizes, g, bad=bad)]
        residual = _residual(dtype, N, g).to(device) if with_residual else None
        for offsets, ks in ((layer, [1, 1, 50, 300, 3000]), (layer, [0, 3, 700, 1, 150_000]),
                            (torch.tensor([0, N]), [3200]), (torch.tensor([0, 5000]), [9])):
            k = torch.tensor(ks)
            acc = torch.full((N,), 7.0, dtype=dtype, device=device)
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
    zeros = [torch.zeros(200_000, dtype=dtype, device=device)]
    zeros[0][[5, 77, 100_000]] = torch.tensor([1.0, -2.0, 0.5], dtype=dtype, device=device)
    for ks in ([2], [3000]):  # heavy ties: the bound fails, the passes read acc
        acc, ref_acc = (torch.empty(200_000, dtype=dtype, device=device) for _ in range(2))
        off, k = torch.tensor([0, 200_000]), torch.tensor(ks)
        for a, b in zip(cuda.compensate_select_topk(acc, zeros, None, off, k),
                        reference.compensate_select_topk(ref_acc, zeros, None, off, k)):
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
    base = base.to(device)
    for itype in (torch.int32, torch.int64):
        idx = torch.sort(torch.randperm(n, generator=g)[:1000]).values.to(itype).to(device)
        sent = torch.randn(1000, generator=g).to(dtype).to(device)
        prev = torch.sort(torch.randperm(n, generator=g)[:800]).values.to(itype).to(device)
        prev[:100] = idx[:100]
        a, b = base.clone(), base.clone()
        assert_same(cuda.subtract_at_(a, idx, sent), reference.subtract_at_(b, idx, sent))
        a, b = base.clone(), base.clone()
        assert_same(cuda.scatter_reset_(a, prev, idx, sent, divisor),
                    reference.scatter_reset_(b, prev, idx, sent, divisor))
    a, b = base.clone(), base.clone()
    assert cuda.div_count_(a, divisor) == reference.div_count_(b, divisor)
    assert_same(a, b)
