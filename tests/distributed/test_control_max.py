"""The consistency check's max over ranks on real gloo groups, P = 1, 2, 3,
5, 8: the dissemination rounds give every rank the elementwise max of every
rank's vector (numpy oracle over the ranks' inputs), in ceil(log2 P)
pairwise rounds and no allreduce, and an emulated link charges one latency
per round (the ring allreduce it replaces paid 2(P-1))."""
import math

import numpy as np
import pytest

import control_workers as cw
from dist_utils import run_workers


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
def test_check_max_is_exact_in_log2_p_rounds(P):
    res = run_workers(P, cw.control_max, timeout=120)
    want = np.max(np.array([cw.vector_of(r, P) for r in range(P)], dtype=np.int64), axis=0).tolist()
    rounds = math.ceil(math.log2(P)) if P > 1 else 0
    for r in res:
        assert r["max"] == want and r["delayed_max"] == want
        assert r["input_unchanged"]
        assert (r["sendrecvs"], r["allreduces"]) == (rounds, 0)
        assert r["delayed_waits"] == rounds
        assert r["control_bytes"] == 8 * len(want)  # counted once per call, as before
