"""The consistency check's max over ranks on real gloo groups of every size
P = 1..8 (subgroups of one 8-process job): the dissemination rounds give
every rank the elementwise max of every rank's vector (numpy oracle over
the ranks' inputs), in ceil(log2 P) pairwise rounds and no allreduce, and
an emulated link charges one latency per round (the ring allreduce it
replaces paid 2(P-1))."""
import math

import numpy as np

import control_workers as cw
from dist_utils import run_workers

WORLD = 8


def test_check_max_is_exact_in_log2_p_rounds_for_every_p():
    res = run_workers(WORLD, cw.control_max, timeout=180)
    for P in range(1, WORLD + 1):
        want = np.max(np.array([cw.vector_of(r, P) for r in range(P)], dtype=np.int64), axis=0).tolist()
        rounds = math.ceil(math.log2(P)) if P > 1 else 0
        assert all(P not in res[r] for r in range(P, WORLD))
        for r in range(P):
            got = res[r][P]
            assert got["max"] == want and got["delayed_max"] == want, (P, r)
            assert got["input_unchanged"]
            assert (got["sendrecvs"], got["allreduces"]) == (rounds, 0), (P, r)
            assert got["delayed_waits"] == rounds, (P, r)
            assert got["control_bytes"] == 8 * len(want)  # counted once per call, as before
