"""A local failure before the exchange -- bad state (a residual that no
longer fits its gradient), buffers that would not fit in memory, a meta
tensor -- is announced through the cross-rank check: the failing rank raises
its own error, every other rank PeerInputError naming it, at once (the
transport's timeout is 300 s, past the job's 200 s limit for all three, so a wait for it
fails the test), nothing is changed, and the next agreeing call works."""
import pytest

from dist_utils import run_workers
from local_failure_workers import every_kind

pytestmark = pytest.mark.distributed

WANT = {"state": ("RuntimeError", "layout changed"),
        "memory": ("ValueError", "GiB"),
        "meta": ("ValueError", "meta device")}


def test_a_local_failure_reaches_every_rank_at_once():
    kinds = sorted(WANT)
    per_rank = run_workers(3, every_kind, kinds, timeout=200)
    for i, kind in enumerate(kinds):
        out = [r[i] for r in per_rank]
        err, text = WANT[kind]
        assert out[1]["first"][0] == err and text in out[1]["first"][1], (kind, out[1])
        for r in (0, 2):
            assert out[r]["first"][0] == "PeerInputError", (kind, out[r])
            assert "rank 1" in out[r]["first"][1] and text in out[r]["first"][1]
        for o in out:
            assert o["unchanged"] and o["second"][0] is None and o["step"] == 2, (kind, o)
