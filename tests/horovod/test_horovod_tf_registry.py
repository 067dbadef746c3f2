"""The registry drives the TensorFlow layer: compressors the
layer has no code of its own for run through ``gtopk_plugin.tensorflow``
under real ``horovodrun -np 3 --gloo`` (tests/jobs/hvd_tf_registry_job.py, a part
of the P = 3 job that runs test_horovod_tf.py's checks too),
eagerly and inside ``tf.function``: the built-in ``onebit`` codec, and a
selector and a codec registered from user code
(tests/support/tf_user_compressors.py).

Checked against the PyTorch side, bit for bit on every rank: the user
selector against ``gtopk_plugin.testing.Oracle`` (sparse allgather and the
gTop-k butterfly), the codecs against the codec contract run with the torch
compressor objects (result = Σ_ranks, in rank order, decode(encode(acc_r));
residual_r = acc_r − decode(encode(acc_r)), as
collectives/payloads.PayloadAllGather and error feedback compute it); mass
conservation; bytes as the PyTorch transport counts them ((P−1)·payload
each way for the payload allgather, no headers).

The codecs' dense warm-up (``start_iter=2``: onebit eagerly and traced,
qsgd traced; frameworks/horovod_tf/tf_step.py) against the torch
``GradientReducer`` with the same settings on the same gradients in the
same job, bit for bit on every rank and step (both sum the warm-up steps
with the same ``ProcessGroupGloo`` allreduce); warm-up steps are the plain
sum with a zero residual and a dense step's bytes, later steps the codec's.
"""
import re
import sys

import numpy as np
import pytest
import torch

from hvd_launch import JOBS, ok  # noqa: E402

sys.path.insert(0, JOBS)
import hvd_tf_shared as shared  # noqa: E402

try:
    import horovod.tensorflow  # noqa: F401
except Exception as e:  # noqa: BLE001
    pytest.skip(f"HOROVOD-TENSORFLOW TESTS SKIPPED: horovod.tensorflow cannot be imported "
                f"({type(e).__name__}: {e}); run `GTOPK_HOROVOD_TF=1 bash scripts/install_horovod.sh`",
                allow_module_level=True)

import tf_user_compressors  # noqa: E402,F401  (registers the user compressors here too)

from gtopk_plugin import registry  # noqa: E402
from gtopk_plugin.compress import SelectionContext  # noqa: E402
from gtopk_plugin.testing import Oracle  # noqa: E402

P = 3
# the registry part of the P = 3 Horovod-TF job, which runs test_horovod_tf.py's
# checks too (tests/jobs/hvd_tf_shared.py)
shared.want(P, "registry")


def results():
    return shared.results(P, "registry")


def _flat(arrays):
    return np.concatenate([a.reshape(-1) for a in arrays])


def _check_mass(runs):
    steps = len(runs[0]["out"])
    grads = sum(_flat(run["raw"][s]).astype(np.float64) for run in runs for s in range(steps))
    outs = sum(_flat(runs[0]["out"][s]).astype(np.float64) for s in range(steps))
    resid = sum(_flat([run["residuals"][k] for k in sorted(run["residuals"])]).astype(np.float64)
                for run in runs)
    assert np.abs(grads - outs - resid).max() < 1e-4, "mass not conserved"


@pytest.mark.timeout(900)  # the first test runs the shared job
@pytest.mark.parametrize("name", ["onebit", "onebit_graph", "half_tf_user_graph"])
def test_codecs_match_the_codec_contract_bit_for_bit(name):
    runs = [ok(res, name) for res in results()]
    method = "half_tf_user" if name.startswith("half") else "onebit"
    comp = registry.get(method)()
    sizes = [a.size for a in runs[0]["raw"][0]]
    offsets = torch.tensor(np.cumsum([0] + sizes), dtype=torch.int64)
    N = sum(sizes)
    names = [f"t{i:04d}" for i in range(len(sizes))]
    residual = [torch.zeros(N) for _ in range(P)]
    for s in range(len(runs[0]["out"])):
        want = torch.zeros(N)
        blob_bytes = 0
        for r in range(P):  # rank order, as every rank sums
            acc = torch.from_numpy(_flat(runs[r]["raw"][s])) + residual[r]
            ctx = SelectionContext(step=s, segment_names=names, seed=0, rank=r, kernels="reference")
            payload = comp.encode(acc, offsets, ctx)
            blob_bytes = sum(t.numel() * t.element_size() for t in payload)
            mine = comp.decode(payload, offsets, N, acc.dtype).reshape(-1)
            residual[r] = acc - mine
            want = want + mine
        for r in range(P):
            got = _flat(runs[r]["out"][s])
            assert got.tobytes() == want.numpy().tobytes(), \
                f"{name} step {s} rank {r}: max diff {np.abs(got - want.numpy()).max():.3g} vs the codec contract"
    for r in range(P):
        got = _flat([runs[r]["residuals"][k] for k in sorted(runs[r]["residuals"])])
        assert got.tobytes() == residual[r].numpy().tobytes(), f"{name}: residual of rank {r}"
        t = runs[r]["traffic"]
        assert t["header_bytes_sent"] == 0 and t["numel"] == N and t["rounds"] == P - 1, t
        assert t["payload_bytes_sent"] == t["payload_bytes_received"] == (P - 1) * blob_bytes, (t, blob_bytes)
        assert runs[r]["step"] == len(runs[r]["out"])
    _check_mass(runs)


@pytest.mark.timeout(900)  # the first test runs the shared job
@pytest.mark.parametrize("name,merge", [("firstk_user", None), ("firstk_user_butterfly_graph", "butterfly")])
def test_user_selector_matches_the_pytorch_oracle_bit_for_bit(name, merge):
    runs = [ok(res, name) for res in results()]
    names = [f"t{i:04d}" for i in range(len(runs[0]["raw"][0]))]
    oracle = Oracle(P, method="firstk_user", density=0.1, merge=merge, op="sum")
    for s in range(len(runs[0]["out"])):
        expect = oracle.step([{n: torch.from_numpy(g) for n, g in zip(names, runs[r]["raw"][s])}
                              for r in range(P)])
        for r in range(P):
            for n, got in zip(names, runs[r]["out"][s]):
                assert got.tobytes() == expect[n].numpy().tobytes(), f"{name} step {s} rank {r} {n}"
    for r in range(P):
        for i, n in enumerate(names):
            assert np.array_equal(runs[r]["residuals"][f"r{i:04d}"], oracle.residuals[r][n].numpy()), (name, r, n)
    assert runs[0]["repr"].startswith("Compression.firstk_user(0.1")
    _check_mass(runs)


def test_merge_the_layer_lacks_is_refused_at_construction():
    """onebit's two-phase compressed allreduce (merge="reduce_scatter_payloads")
    runs in the PyTorch layers only: the TensorFlow layer refuses it when the
    compression is built (the same on every rank, before any step), naming
    what it has; the default merges of the codecs are accepted."""
    from gtopk_plugin.frameworks.horovod_tf.tf_compression import SparseCompression

    with pytest.raises(ValueError, match="not available in the TensorFlow layer.*allgather_payloads"):
        SparseCompression("onebit", merge="reduce_scatter_payloads")
    for method, kw in (("onebit", {}), ("powersgd", {"rank": 2}), ("gtopk", {})):
        SparseCompression(method, **kw)


WARM_FIELDS = ("payload_bytes_sent", "payload_bytes_received", "header_bytes_sent", "header_bytes_received",
               "control_bytes", "messages_sent", "numel", "k", "sent_entries", "rounds", "dense_bytes")


@pytest.mark.timeout(900)  # the first test runs the shared job
@pytest.mark.parametrize("name", ["onebit_warm", "onebit_warm_graph", "qsgd_warm_graph"])
def test_codec_dense_warmup_start_iter_equals_the_torch_reducer(name):
    """Steps 0 and 1 (before start_iter=2) are the dense method's step: the
    sum over the ranks (float64 sum to fp32 tolerance; the torch reducer's
    bits), residual zero, the ring allreduce's bytes (= dense_bytes), 2(P−1)
    rounds; steps 2 and 3 the codec's payload allgather with a residual.
    Every step: the torch reducer's bits and statistics, the same bits on
    every rank; final residuals the reducer's; mass conserved."""
    runs = [ok(res, name) for res in results()]
    assert re.fullmatch(r"Compression\.(onebit|qsgd)\((seed=\d+, )?start_iter=2\)", runs[0]["repr"]), runs[0]["repr"]
    steps, N = len(runs[0]["tf"]), sum(a.size for a in runs[0]["raw"][0])
    assert steps == 4
    for s in range(steps):
        warm = s < 2
        if warm:  # op=Sum: the plain sum of the ranks' gradients (gloo's order: fp32 tolerance)
            want = sum(_flat(run["raw"][s]).astype(np.float64) for run in runs)
            assert np.allclose(_flat(runs[0]["tf"][s]), want, rtol=1e-6, atol=1e-6), (name, s)
        for r, run in enumerate(runs):
            for i, (a, b) in enumerate(zip(run["tf"][s], run["torch"][s])):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert a.tobytes() == b.tobytes(), (
                    f"{name} rank {r} step {s} tensor {i}: TF differs from the torch reducer "
                    f"(max |diff| {np.abs(a.astype(np.float64) - b).max():.3g})")
                assert a.tobytes() == runs[0]["tf"][s][i].tobytes(), f"{name} rank {r} step {s}: ranks disagree"
            t, ts = run["traffic"][s], run["torch_stats"][s]
            for key in WARM_FIELDS:
                assert t[key] == ts[key], (name, s, key, t[key], ts[key])
            resid = _flat([run["residuals"][s][k] for k in sorted(run["residuals"][s])])
            assert t["numel"] == t["sent_entries"] == N and t["header_bytes_sent"] == 0
            if warm:
                assert ts["aggregation"] == "dense" and not resid.any(), (name, s)
                ring = 2 * (P - 1) * 4 * N // P
                assert t["payload_bytes_sent"] == t["payload_bytes_received"] == ring == t["dense_bytes"], t
                assert t["messages_sent"] == t["rounds"] == 2 * (P - 1), t
            else:
                assert ts["aggregation"] == "allgather_payloads" and resid.any(), (name, s)
                assert 0 < t["payload_bytes_sent"] < t["dense_bytes"] / 2 and t["rounds"] == P - 1, t
    for r, run in enumerate(runs):
        last = run["residuals"][-1]
        for key, a in last.items():
            assert a.tobytes() == run["torch_residuals"]["t" + key[1:]].tobytes(), f"{name} rank {r} residual {key}"
    _check_mass([{"raw": run["raw"], "out": run["tf"], "residuals": run["residuals"][-1]} for run in runs])
