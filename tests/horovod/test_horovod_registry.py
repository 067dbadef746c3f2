"""The registry drives the PyTorch Horovod layer too: the
``onebit`` codec and a codec registered from user code run through
``gtopk_plugin.horovod.DistributedOptimizer`` under real ``horovodrun -np 3
--gloo``, and ``Compression.none`` is Horovod's own optimizer with our
``last_step_traffic``.

Checked: identical bits on every rank; mass conserved (op=sum:
Σ grads = Σ results + Σ residuals); the user codec's result is, bit for bit,
the rank-order float32 sum of every rank's float16 accumulator (its
residual is what float16 dropped); bytes are the allgather's
(P−1)·payload each way and the dense ring model.
"""
import os

import pytest
import torch

from hvd_launch import require_horovod  # noqa: E402

require_horovod()

from hvd_launch import job_results, ok  # noqa: E402

P = 3
_RES = []


def _load_torch(d, r):
    return torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False)


def results():
    if not _RES:
        _RES.extend(job_results(P, "hvd_torch_registry_job.py", _load_torch))
    return _RES


def flat(d):
    return torch.cat([d[n].reshape(-1).double() for n in sorted(d)])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("method", ["onebit", "half_user"])
def test_codecs_agree_across_ranks_and_conserve_mass(method):
    runs = [ok(res, method) for res in results()]
    assert runs[0]["type"] == "gtopk_plugin.frameworks.horovod.hvd_optimizer"
    steps = len(runs[0]["out"])
    for s in range(steps):
        for r in range(1, P):
            for n, t in runs[0]["out"][s].items():
                assert torch.equal(runs[r]["out"][s][n], t), f"{method} step {s}: rank {r} differs on {n}"
    grads = sum(flat(run["raw"][s]) for run in runs for s in range(steps))
    outs = sum(flat(runs[0]["out"][s]) for s in range(steps))
    resid = sum(flat(run["residuals"]) for run in runs)
    assert (grads - outs - resid).abs().max().item() < 1e-4, f"{method}: mass not conserved"
    numel = sum(t.numel() for t in runs[0]["out"][0].values())
    for run in runs:
        for t in run["traffic"]:
            assert t["header_bytes_sent"] == 0 and t["numel"] == numel and t["buckets"] == 1
            assert t["payload_bytes_sent"] == t["payload_bytes_received"] > 0
            if method == "half_user":  # one float16 payload per rank, ring allgather
                assert t["payload_bytes_sent"] == (P - 1) * numel * 2


@pytest.mark.timeout(400)
def test_user_codec_result_is_the_rank_order_sum_of_float16_accumulators():
    runs = [ok(res, "half_user") for res in results()]
    names = sorted(runs[0]["raw"][0])
    residual = [{n: torch.zeros_like(runs[r]["raw"][0][n]) for n in names} for r in range(P)]
    for s in range(len(runs[0]["out"])):
        want = None
        for r in range(P):
            acc = {n: runs[r]["raw"][s][n] + residual[r][n] for n in names}
            sent = {n: acc[n].to(torch.float16).float() for n in names}
            residual[r] = {n: acc[n] - sent[n] for n in names}
            want = sent if want is None else {n: want[n] + sent[n] for n in names}
        for n in names:
            assert torch.equal(runs[0]["out"][s][n], want[n]), f"step {s} {n}"
    for r in range(P):
        for n in names:
            assert torch.equal(runs[r]["residuals"][n].reshape(residual[r][n].shape), residual[r][n])


@pytest.mark.timeout(400)
def test_dense_none_is_horovods_optimizer_with_ring_traffic():
    runs = [ok(res, "none") for res in results()]
    numel = sum(t.numel() for t in runs[0]["out"][0].values())
    for run in runs:
        assert run["type"] == "horovod.torch.optimizer"
        for s, t in enumerate(run["traffic"]):
            assert t["bytes_sent"] == t["bytes_received"] == 2 * (P - 1) * numel * 4 // P
            assert t["dense_bytes"] == t["bytes_sent"] and t["control_bytes"] == 0
            for n, g in run["out"][s].items():
                assert torch.equal(g, runs[0]["out"][s][n])


@pytest.mark.timeout(400)
def test_dense_below_sends_small_tensors_dense_and_conserves_mass():
    # Compression.gtopk(0.1, dense_below=12): the two biases (10 and 3
    # entries) are summed exactly (dense, no residual), the weights by gTop-k
    # with error feedback; op=Sum.
    runs = [ok(res, "gtopk_dense_below") for res in results()]
    assert "dense_below=12" in runs[0]["repr"]
    small = [n for n, t in runs[0]["raw"][0].items() if t.numel() < 12]
    assert len(small) == 2
    steps = len(runs[0]["out"])
    for s in range(steps):
        for r in range(1, P):
            for n, t in runs[0]["out"][s].items():
                assert torch.equal(runs[r]["out"][s][n], t), f"step {s}: rank {r} differs on {n}"
        for n in small:  # the plain sum of the ranks' gradients (ring order: fp32 tolerance)
            want = sum(run["raw"][s][n].double() for run in runs)
            assert torch.allclose(runs[0]["out"][s][n].double(), want, rtol=1e-6, atol=1e-7), n
    for run in runs:
        for n in small:  # dense sends everything: no residual for the small tensors
            assert n not in run["residuals"] or not run["residuals"][n].abs().max().item()
    grads = sum(flat(run["raw"][s]) for run in runs for s in range(steps))
    outs = sum(flat(runs[0]["out"][s]) for s in range(steps))
    names = sorted(runs[0]["raw"][0])
    resid = sum(torch.cat([run["residuals"][n].reshape(-1).double() if n in run["residuals"]
                           else torch.zeros(runs[0]["raw"][0][n].numel(), dtype=torch.float64)
                           for n in names]) for run in runs)
    assert (grads - outs - resid).abs().max().item() < 1e-4, "mass not conserved"
    big = sum(t.numel() for n, t in runs[0]["raw"][0].items() if n not in small)
    small_numel = sum(runs[0]["raw"][0][n].numel() for n in small)
    for run in runs:
        for t in run["traffic"]:
            # the small part's ring allreduce is counted in full, the rest is sparse
            assert t["bytes_sent"] >= 2 * (P - 1) * small_numel * 4 // P
            assert t["bytes_sent"] < 2 * (P - 1) * (big + small_numel) * 4 // P


@pytest.mark.timeout(400)
def test_codec_dense_warmup_start_iter():
    # Compression.onebit(start_iter=2), op=Sum: steps 0 and 1 are a dense
    # allreduce (the plain sum, no residual, a ring allreduce's bytes), step
    # 2 is onebit (fewer bytes, a residual); mass conserved over the run.
    runs = [ok(res, "onebit_warm") for res in results()]
    assert "start_iter=2" in runs[0]["repr"]
    names = sorted(runs[0]["raw"][0])
    for s in range(2):
        for n in names:  # the plain sum of the ranks' gradients (ring order: fp32 tolerance)
            want = sum(run["raw"][s][n].double() for run in runs)
            assert torch.allclose(runs[0]["out"][s][n].double(), want, rtol=1e-6, atol=1e-7), (s, n)
        for run in runs:
            t = run["traffic"][s]
            assert abs(t["bytes_sent"] - t["dense_bytes"]) <= 2 * (P - 1) * 4, t
    for run in runs:
        t = run["traffic"][2]
        assert 0 < t["bytes_sent"] < t["dense_bytes"] / 8
        for s in range(3):
            for n in names:
                assert torch.equal(run["out"][s][n], runs[0]["out"][s][n])
    assert any(run["residuals"][n].abs().max().item() > 0 for run in runs for n in names)
    grads = sum(flat(run["raw"][s]) for run in runs for s in range(3))
    outs = sum(flat(runs[0]["out"][s]) for s in range(3))
    resid = sum(flat(run["residuals"]) for run in runs)
    assert (grads - outs - resid).abs().max().item() < 1e-4, "mass not conserved"
