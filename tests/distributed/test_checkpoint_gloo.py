"""Whole-job checkpoints on real gloo groups (gtopk_plugin/checkpoint.py):
a P = 4 job trains gTop-k (op="sum"), gTop-k with DGC momentum and a
dense_below part, and PowerSGD, and saves each with ``gp.save_job``; jobs
of P' = 4, 3 and 2 ranks load them with ``gp.load_job`` and train on.

Checked against oracles independent of the checkpoint code:
- new rank j's residuals and velocities are, bit for bit, the float32 sum
  of the saved states of old ranks i ≡ j (mod P') added in increasing i
  (computed here from the saving job's own snapshots);
- Σ_ranks residual (float64) is conserved: exactly at P' = 4; at P' = 3, 2
  within the rounding of those float32 additions, 2^-24·|a + b| per
  addition and entry (the standard model: one rounding per addition);
- mass conservation across the move (op="sum"): Σ_ranks residual loaded +
  Σ_ranks Σ_steps grad = Σ_steps result + Σ_ranks residual at the end, to
  1e-4 absolute (float32 state, entries of size ~1-10, 3 steps);
- every rank applies the same updates after the move, steps continue;
- PowerSGD's warm-start factors (the same on every rank) are kept;
- a NaN in one old rank's file: every new rank raises, nothing changed;
- one rank's state loaded by every rank (the old quickstart's pattern), or
  a rank file loaded at another world size: a clear error;
- Horovod elastic's live rule (checkpoint.exchange_live) when rank 2 of 4
  leaves: the survivors' states land on new rank (old rank mod 3) and
  their sum is kept.
"""
import os

import pytest
import torch

from checkpoint_workers import CONFIGS, SHAPES, live_worker, load_worker, save_worker
from dist_utils import run_workers
from gtopk_plugin import checkpoint

STEPS, MORE = 4, 3
U = 2.0 ** -24  # float32 unit roundoff


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    res = run_workers(4, save_worker, root, STEPS, timeout=240)
    # a copy of the gTop-k checkpoint with a NaN in old rank 1's residual
    corrupt = os.path.join(root, "corrupt")
    os.makedirs(corrupt)
    src = os.path.join(root, "gtopk")
    for f in os.listdir(src):
        obj = torch.load(os.path.join(src, f), weights_only=True)
        if f == "rank1.pt":
            obj["state"]["residuals"]["w"].view(-1)[7] = float("nan")
        torch.save(obj, os.path.join(corrupt, f))
    return root, res, corrupt


def _oracle(states, part, j, P_new):
    """float32 sum, increasing old rank, of old ranks i ≡ j (mod P_new), and
    the rounding bound of those additions."""
    src = [states[i] for i in range(len(states)) if i % P_new == j]
    names = sorted(set().union(*[set(s[part]) for s in src])) if src else []
    out, bound = {}, {}
    for n in names:
        ts = [s[part][n] for s in src if n in s[part]]
        acc, b = ts[0].clone(), torch.zeros(ts[0].shape, dtype=torch.float64)
        for t in ts[1:]:
            b += (acc.double() + t.double()).abs() * U
            acc = acc + t
        out[n], bound[n] = acc, b
    return out, bound


@pytest.mark.timeout(300)
def test_save_at_4_and_every_rank_loading_one_rank_state_is_refused(saved):
    root, res, _ = saved
    man = checkpoint.read_manifest(os.path.join(root, "gtopk"))
    assert man["world_size"] == 4 and man["step"] == STEPS
    assert sorted(os.listdir(os.path.join(root, "gtopk"))) == ["job.pt"] + [f"rank{r}.pt" for r in range(4)]
    assert res[0]["rank0_state"] is None
    for r in (1, 2, 3):
        assert f"saved by rank 0, this is rank {r} (of 4)" in res[r]["rank0_state"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P_new", [4, 3, 2])
def test_load_at_another_world_size_conserves_residuals_and_trains_on(saved, P_new):
    root, old, corrupt = saved
    new = run_workers(P_new, load_worker, root, MORE, STEPS, corrupt, timeout=240)
    for name in CONFIGS:
        states = [old[i][name]["state"] for i in range(4)]
        parts = ("residuals", "velocities", "small")
        for j in range(P_new):
            got = new[j][name]["loaded"]
            assert got["step"] == STEPS
            for part in parts:
                want, _ = _oracle(states, part, j, P_new)
                assert sorted(got[part]) == sorted(want), (name, j, part)
                for n, t in want.items():
                    assert torch.equal(got[part][n], t), (name, j, part, n)
            if name == "powersgd":  # the same warm-start factors on every rank, kept
                assert states[0]["compressor"]["q"], "PowerSGD kept no factors"
                for n, q in states[0]["compressor"]["q"].items():
                    assert torch.equal(got["compressor"]["q"][n], q)
        # Σ_ranks residual (and velocity) over the move
        for part in parts:
            for n in set().union(*[set(s[part]) for s in states]):
                before = sum(s[part][n].double() for s in states if n in s[part])
                after = sum(new[j][name]["loaded"][part][n].double() for j in range(P_new)
                            if n in new[j][name]["loaded"][part])
                if P_new == 4:
                    assert torch.equal(after, before), (name, part, n)
                else:
                    bound = sum(_oracle(states, part, j, P_new)[1].get(n, 0.0) for j in range(P_new))
                    assert bool(((after - before).abs() <= bound).all()), (name, part, n)
        # training goes on: the same updates on every rank, the step counts on
        for j in range(P_new):
            assert new[j][name]["step"] == STEPS + MORE
            for t in range(MORE):
                for n in SHAPES:
                    u = new[j][name]["outs"][t][n]
                    assert torch.isfinite(u).all() and torch.equal(u, new[0][name]["outs"][t][n])
        if name == "gtopk":  # mass conservation across the move (op="sum")
            for n in SHAPES:
                loaded = sum(new[j][name]["loaded"]["residuals"].get(n, torch.zeros(0)).double().reshape(-1)
                             for j in range(P_new)).reshape(SHAPES[n])
                end = sum(new[j][name]["end"]["residuals"][n].double() for j in range(P_new)).reshape(SHAPES[n])
                grad = sum(new[j][name]["gsum"][n] for j in range(P_new))
                torch.testing.assert_close(loaded + grad, new[0][name]["usum"][n] + end, rtol=0, atol=1e-4)
    for j in range(P_new):
        # a NaN in old rank 1's file: every rank raises, naming it; nothing changed
        msg = new[j]["corrupt"]
        assert msg is not None and f"rank {1 % P_new}:" in msg and "residuals['w'] holds 1 non-finite" in msg
        assert new[j]["corrupt_unchanged"]
        direct = new[j]["direct"]
        if P_new == 4:
            assert direct is None  # its own rank's file
        else:
            assert f"of a 4-rank job, this job has {P_new} ranks" in direct and "load_job" in direct


@pytest.mark.timeout(300)
def test_elastic_live_exchange_when_a_rank_leaves(saved):
    root, _, _ = saved
    res = run_workers(4, live_worker, root, timeout=240)
    old = [res[i]["old"]["residuals"] for i in range(4)]
    survivors = [0, 1, 3]
    for new_rank, g in enumerate(survivors):
        assert res[g]["new_rank"] == new_rank and res[g]["moved"] is True
        want, _ = _oracle([res[i]["old"] if i != 2 else {"residuals": {}} for i in range(4)],
                          "residuals", new_rank, 3)
        got = res[g]["after"]["residuals"]
        assert sorted(got) == sorted(want)
        for n, t in want.items():
            assert torch.equal(got[n], t), (new_rank, n)
    assert res[3]["after"]["residuals"] == {}  # old rank 3's state went to new rank 0 (3 mod 3)
    for n in old[0]:
        before = old[0][n].double() + old[1][n].double() + old[3][n].double()
        after = sum(res[g]["after"]["residuals"].get(n, torch.zeros(before.shape, dtype=torch.float32)).double()
                    for g in survivors)
        bound = (old[0][n].double() + old[3][n].double()).abs() * U
        assert bool(((after - before).abs() <= bound).all())
        # and the survivors train on: mass conserved on the new world
        shape = SHAPES[n]
        end = sum(res[g]["end"]["residuals"][n].double() for g in survivors).reshape(shape)
        grad = sum(res[g]["gsum"][n] for g in survivors)
        torch.testing.assert_close(after.reshape(shape) + grad, res[0]["usum"][n] + end, rtol=0, atol=1e-4)
