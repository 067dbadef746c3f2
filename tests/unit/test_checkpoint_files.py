"""gp.save_job / gp.load_job on one process (P = 1, SingleProcessTransport):
the files a job checkpoint consists of, a bit-exact round trip, a
checkpoint of a 2-rank job loaded by one rank (the sum of both states,
against an independent float32 sum), and the checkpoints that must be
refused with nothing changed: no manifest, a file from another save, a
rank file edited to hold another step, a NaN state (refused at save)."""
import copy
import os
import shutil

import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin import checkpoint

SHAPES = {"w": (6, 5), "v": (40,)}


def _grads(step, scale=1.0):
    g = torch.Generator().manual_seed(31 + step)
    return {n: torch.randn(s, generator=g) * scale for n, s in SHAPES.items()}


def _trained(steps=3, scale=1.0):
    red = gp.GradientReducer("gtopk", 0.1, momentum_correction=0.9, seed=2, transport=gp.SingleProcessTransport())
    for s in range(steps):
        red.reduce(_grads(s, scale))
    return red


def _parts(red):
    return ({n: r.clone() for n, r in red.memory.residuals.items()},
            {n: u.clone() for n, u in red.momentum.velocities.items()}, red.step)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_save_and_load_round_trip(tmp_path):
    red = _trained()
    path = str(tmp_path / "ckpt")
    assert gp.save_job(red, path) == path
    assert sorted(os.listdir(path)) == ["job.pt", "rank0.pt"]
    man = checkpoint.read_manifest(path)
    assert man["world_size"] == 1 and man["step"] == 3
    saved = _parts(red)
    twin = _trained()
    red.reduce(_grads(10))  # moves on; the load must bring back the saved state
    gp.load_job(red, path, named_parameters=iter({n: torch.zeros(s) for n, s in SHAPES.items()}.items()))
    assert _same(_parts(red), saved)
    assert _same(red.reduce(_grads(11)), twin.reduce(_grads(11)))


def _two_rank_checkpoint(path):
    """A 2-rank job's checkpoint, written as save_job writes one."""
    states = []
    for i in range(2):
        red = _trained(scale=1.0 + i)
        sd = copy.deepcopy(red.state_dict())
        sd["rank"], sd["world_size"] = i, 2
        states.append(sd)
    os.makedirs(path)
    token = "t0"
    for i, sd in enumerate(states):
        torch.save({"format": checkpoint.FORMAT, "kind": "rank", "token": token, "state": sd},
                   checkpoint.rank_file(path, i))
    torch.save({"format": checkpoint.FORMAT, "kind": "job", "version": checkpoint.JOB_VERSION, "token": token,
                "world_size": 2, "step": 3, "ranks": [checkpoint._info(s) for s in states]},
               os.path.join(path, checkpoint.MANIFEST))
    return states


def test_two_rank_checkpoint_loaded_by_one_rank_is_the_sum(tmp_path):
    path = str(tmp_path / "two")
    states = _two_rank_checkpoint(path)
    red = gp.GradientReducer("gtopk", 0.1, momentum_correction=0.9, seed=2, transport=gp.SingleProcessTransport())
    with pytest.raises(ValueError, match="2-rank job, this job has 1 ranks"):
        red.load_state_dict(copy.deepcopy(states[1]))
    gp.load_job(red, path, named_parameters=iter({n: torch.zeros(s) for n, s in SHAPES.items()}.items()))
    res, vel, step = _parts(red)
    assert step == 3
    for part, got in (("residuals", res), ("velocities", vel)):
        assert sorted(got) == sorted(states[0][part])
        for n in got:
            assert torch.equal(got[n], states[0][part][n] + states[1][part][n]), (part, n)


def _refused(red, path, pattern):
    before = _parts(red)
    with pytest.raises(gp.CheckpointError, match=pattern):
        gp.load_job(red, path)
    assert _same(_parts(red), before)


def test_incomplete_or_mixed_checkpoints_are_refused(tmp_path):
    red = _trained(scale=0.5)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    gp.save_job(_trained(), a)
    gp.save_job(_trained(steps=3, scale=2.0), b)
    _refused(red, str(tmp_path / "none"), "job.pt is missing")
    mixed = str(tmp_path / "mixed")
    shutil.copytree(a, mixed)
    shutil.copy(checkpoint.rank_file(b, 0), checkpoint.rank_file(mixed, 0))
    _refused(red, mixed, "belongs to another save")
    edited = str(tmp_path / "edited")
    shutil.copytree(a, edited)
    obj = torch.load(checkpoint.rank_file(edited, 0), weights_only=True)
    obj["state"]["step"] = 9
    torch.save(obj, checkpoint.rank_file(edited, 0))
    _refused(red, edited, "at step 9; the manifest expects rank 0 of 1 at step 3")
    os.remove(os.path.join(a, "job.pt"))  # a save that never finished
    _refused(red, a, "job.pt is missing")


def test_a_nan_state_is_not_saved(tmp_path):
    red = _trained()
    red.memory.residuals["w"].view(-1)[2] = float("nan")
    path = str(tmp_path / "nan")
    with pytest.raises(gp.CheckpointError, match=r"rank 0: CheckpointError: .*residuals\['w'\] holds 1 non-finite"):
        gp.save_job(red, path)
    assert not os.path.exists(os.path.join(path, "job.pt"))


def test_only_a_gradient_reducer():
    with pytest.raises(TypeError, match="HierarchicalReducer"):
        gp.save_job(gp.HierarchicalReducer("gtopk", 0.1, local_size=1), "x")
