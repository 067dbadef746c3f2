"""Checkpoints of the Horovod PyTorch layer on a real ``horovodrun -np 3``
job (tests/jobs/hvd_checkpoint_job.py): the hvd.elastic state handler moves
the live residuals at a resize by the rule of gtopk_plugin.checkpoint (new
rank j holds the float32 sum, in increasing old rank, of the states made on
old ranks ≡ j mod P' -- the oracle here is that sum of the job's own
"before" residuals), restores each process's own commit, and
``gp.save_job``/``gp.load_job`` run on the Horovod transport (round trip
bit for bit; a NaN in one rank's file refused on every rank, nothing
changed)."""
import os
import tempfile

import pytest
import torch

pytest.importorskip("horovod.torch", reason="HOROVOD TESTS SKIPPED: horovod cannot be imported")

from hvd_launch import JOBS, horovodrun  # noqa: E402

HOMES = {0: 0, 1: 3, 2: 1}  # rank -> the old rank its state was made on (of 4)


@pytest.mark.timeout(300)
def test_elastic_resize_moves_residuals_and_job_checkpoints_on_horovod():
    with tempfile.TemporaryDirectory(prefix="gtopk-hvd-ckpt-") as d:
        rc, out = horovodrun(3, [os.path.join(JOBS, "hvd_checkpoint_job.py"), d], timeout=240)
        assert rc == 0, out[-6000:]
        res = [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(3)]
    for r, (status, val) in enumerate(res):
        assert status == "ok", f"rank {r}: {val[0]}: {val[1]}\n{val[2]}"
    res = [v for _, v in res]
    before = {HOMES[r]: res[r]["before"] for r in range(3)}
    total_before = {n: sum(before[i][n].double() for i in before) for n in before[0]}
    for j in range(3):
        src = [before[i] for i in sorted(before) if i % 3 == j]
        got = res[j]["after"]
        want = {}
        for n in sorted(set().union(*[set(s) for s in src])) if src else []:
            ts = [s[n] for s in src if n in s]
            acc = ts[0].clone()
            for t in ts[1:]:
                acc = acc + t
            want[n] = acc
        assert sorted(got) == sorted(want), (j, sorted(got), sorted(want))
        for n, t in want.items():
            assert torch.equal(got[n], t), f"rank {j}: residual {n} is not the sum of its old ranks'"
        assert res[j]["home_after"] == (j, 3)
    assert res[2]["after"] == {}  # its state (old rank 1) went to new rank 1; nothing came to rank 2
    for n, want in total_before.items():  # Σ over ranks: within one float32 rounding of old ranks 0 + 3
        got = sum(res[j]["after"][n].double() for j in range(3) if n in res[j]["after"])
        bound = (before[0][n].double() + before[3][n].double()).abs() * 2.0 ** -24
        assert bool(((got - want).abs() <= bound).all()), n
    for r in range(3):
        assert res[r]["step"] == 5
        for n, p in res[r]["params"].items():
            assert torch.equal(p, res[0]["params"][n]), f"rank {r}: {n} differs after the resize"
        assert set(res[r]["restored"]) == set(res[r]["committed"])
        for n, t in res[r]["committed"].items():
            assert torch.equal(res[r]["restored"][n], t), f"rank {r}: {n} not restored"
        assert res[r]["job_round_trip"]
        msg = res[r]["corrupt"]
        assert msg is not None and "rank 2:" in msg and "non-finite" in msg, msg
        assert res[r]["corrupt_unchanged"]
