"""Momentum correction, local clipping and GradScaler in the Horovod PyTorch
layer under real ``horovodrun -np N --gloo`` jobs, checked
against the independent numpy momentum oracle (tests/support/momentum_oracle.py)."""
import math
import os
import tempfile

import pytest
import torch

from hvd_launch import require_horovod  # noqa: E402

require_horovod()

from hvd_launch import JOBS, horovodrun  # noqa: E402
from momentum_oracle import NumpyMomentumOracle  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
_JOBS = {}
LR = 0.05


def job(np_):
    if np_ not in _JOBS:
        with tempfile.TemporaryDirectory(prefix="gtopk-hvd-mc-") as d:
            rc, out = horovodrun(np_, [os.path.join(JOBS, "hvd_torch_jobs.py"), "momentum", d])
            assert rc == 0, f"horovodrun -np {np_} failed (rc {rc}):\n{out[-6000:]}"
            _JOBS[np_] = [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(np_)]
    return _JOBS[np_]


def ok(res, key):
    for r in res:
        status, val = r[key]
        assert status == "ok", f"rank {r['rank']} {key}: {val[0]}: {val[1]}\n{val[2]}"
    return [r[key][1] for r in res]


def _clip(grads, c, P):
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    thr = c / math.sqrt(P)
    return grads if norm <= thr else {n: g * (thr / (norm + 1e-6 * thr)) for n, g in grads.items()}


def _replay(runs, P, nesterov=False, wd=0.0, clip=None):
    """Oracle weights: numpy momentum correction on every rank's local
    gradients (+ wd·p, clipped), averaged, then p ← p − lr·update."""
    oracle = NumpyMomentumOracle(P, 0.9, nesterov=nesterov, method="gtopk", density=0.2, op="average")
    r0 = runs[0]
    for s in range(len(r0["raw"])):
        p = r0["before"][s]
        grads = []
        for r in range(P):
            g = dict(runs[r]["raw"][s])
            if clip is not None:
                g = _clip(g, clip, P)
            grads.append({n: (g[n] + wd * p[n]) if wd else g[n] for n in g})
        upd = oracle.step(grads)
        want = {n: p[n] - LR * upd[n] for n in p}
        got = r0["before"][s + 1] if s + 1 < len(r0["raw"]) else r0["params"]
        for n in p:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=f"step {s} {n}")
    return oracle


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("key,kw", [("mc_plain", {}), ("mc_nesterov_wd", dict(nesterov=True, wd=1e-2)),
                                    ("mc_clip", dict(clip=0.05))])
def test_horovod_momentum_correction_matches_numpy_oracle(np_, key, kw):
    runs = ok(job(np_), key)
    assert runs[0]["buckets"] > 1, "the job must reduce several buckets per step"
    oracle = _replay(runs, np_, **kw)
    for r, run in enumerate(runs):
        # the optimizer keeps the user's settings and applies no momentum of its own
        assert run["momentum"] == 0.9 and run["wd"] == kw.get("wd", 0.0)
        assert "momentum_buffer" not in run["buffers"] or True
        for n, u in run["velocities"].items():
            torch.testing.assert_close(u.reshape(-1), torch.from_numpy(oracle.u[r][n]), rtol=1e-4, atol=1e-5)
        assert all(torch.equal(run["params"][n], runs[0]["params"][n]) for n in run["params"])


@pytest.mark.parametrize("np_", [2])
def test_horovod_grad_scaler_scale_changes(np_):
    """A real GradScaler whose scale doubles every step (growth_interval=1):
    with clipping and correction the weights equal the unscaled run."""
    plain = ok(job(np_), "mc_clip")
    scaled = ok(job(np_), "mc_clip_scaler")
    assert len(set(scaled[0]["scales"])) == len(scaled[0]["scales"]) > 1
    for n, p in plain[0]["params"].items():
        torch.testing.assert_close(scaled[0]["params"][n], p, rtol=1e-5, atol=1e-6)


def test_horovod_warns_and_refuses():
    res = job(2)
    msgs = ok(res, "mc_warning")[0]
    assert any("momentum_correction=True" in m for m in msgs), msgs
    for r in res:
        status, val = r["mc_adam"]
        assert status == "error" and val[0] == "ValueError" and "Adam" in val[1]


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("method", ["gtopk", "topk"])
def test_hvd_join_with_uneven_data_fails_clearly_on_every_rank(np_, method):
    """hvd.join() with a sparse compression: rank 0 joins after 2 steps; every
    other rank's next step raises JoinedRankError (clear message, no hang,
    residuals unchanged) and then joins as well."""
    runs = ok(job(np_), f"join_{method}")
    assert runs[0]["error"] is None and runs[0]["done"] == 2
    for r in runs[1:]:
        assert r["error"] is not None and r["error"][0] == "JoinedRankError", r["error"]
        assert "hvd.join()" in r["error"][1] and r["done"] == 2
        assert r["residuals_kept"]
