"""The transport's error handling on real gloo groups: every wait of the
error path bounded by the transport's own timeout (not the process
group's), a clear error for a second thread on one transport or one group
(process alive, the first thread's call intact), and a clear error for a
rank outside a subgroup.  Every test has a timeout; none asserts a time:
the process groups' own timeout (300 s) is longer than the job's, so a
wait that fell back to it fails the job instead of passing slowly."""
import pytest

import transport_error_workers as tw
from dist_utils import run_workers

TIMEOUT = 5.0          # the transport's
STALL = 2.0            # the transport's where every call must time out (rank 0's five in a row)
PG_TIMEOUT = 300       # the process group's: never reached by a passing test
JOB = 120              # the launcher kills the job past this


@pytest.mark.timeout(JOB + 60)
def test_each_primitive_of_the_error_path_honours_the_transport_timeout():
    res = run_workers(2, tw.stalled_peer_primitives, STALL, TIMEOUT, timeout=JOB, pg_timeout=PG_TIMEOUT)
    got = res[0]
    for case in tw.PRIMITIVES:
        status, exc, msg, _ = got[case]
        assert status == "error" and exc == "RuntimeError", (case, got[case])
        assert "gtopk_plugin" in msg and f"within {STALL:g} s" in msg, (case, msg)
    # control: the same calls with both ranks present give the collective's result
    for r in range(2):
        together = res[r]["together"]
        assert together["control_max_dissemination"] == [1, 0]
        assert together["control_max_allreduce"] == [1, 0]
        assert together["allgather_object"] == [{"rank": 0, "why": "details"}, {"rank": 1, "why": "details"}]
        assert together["allreduce_sum"] == [3.0] * 4
        assert together["exchange"] == [1 - r] * 8


@pytest.mark.timeout(JOB + 60)
def test_a_rank_failing_before_the_exchange_makes_its_peers_raise_its_error():
    P, failing = 3, 1
    res = run_workers(P, tw.announced_failure, failing, TIMEOUT, timeout=JOB, pg_timeout=PG_TIMEOUT)
    why = f"rank {failing}: out= has the wrong shape (3,) for 'w' (4,)"
    for r in range(P):
        status, exc, msg, _ = res[r]["prompt"]
        assert status == "error", res[r]["prompt"]
        if r == failing:
            assert exc == "ValueError" and msg == why
        else:  # the failing rank's own message, naming it
            assert exc == "PeerInputError" and f"rank {failing}" in msg and why in msg, msg
    # the failing rank stalls between the announcement and its details: the
    # peers raise within the transport's timeout, not the process group's
    for r in range(P):
        status, exc, msg, classes = res[r]["stalled"]
        assert status == "error" and "RuntimeError" in classes, res[r]["stalled"]
        if r != failing:
            assert "gtopk_plugin" in msg and f"within {TIMEOUT:g} s" in msg, msg


@pytest.mark.timeout(JOB + 60)
def test_a_second_thread_on_one_transport_or_one_group_gets_a_clear_error():
    res = run_workers(2, tw.two_threads, TIMEOUT, timeout=JOB, pg_timeout=PG_TIMEOUT)
    for r in range(2):
        out = res[r]
        for which in ("same", "same_group"):
            for call, outcome in out[which].items():
                status, exc, msg, _ = outcome
                assert status == "error" and exc == "ConcurrentUseError", (which, call, outcome)
                assert "not thread-safe" in msg and "reducer-a" in msg, msg
        # another group may be used meanwhile; the held call completes intact
        assert out["other_group"] == ("ok", [30.0] * 3)
        assert out["first"] == [3.0] * 5  # 1 + 2: nothing of the refused calls reached the group
        # sequential use from different threads stays allowed
        assert out["sequential"] == [[1, 7], [("from", 0), ("from", 1)], [1.0, 1.0]]


@pytest.mark.timeout(JOB + 60)
def test_two_reducers_on_one_group_from_two_threads_get_a_clear_error():
    res = run_workers(2, tw.two_reducers_one_group, TIMEOUT, timeout=JOB, pg_timeout=PG_TIMEOUT)
    want = [float(i * (1 + 2)) for i in range(6)]  # Σ_r arange(6)·(r+1)
    for r in range(2):
        status, exc, msg, _ = res[r]["second"]
        assert status == "error" and exc == "ConcurrentUseError", res[r]["second"]
        assert res[r]["first"] == want
        assert res[r]["after"] == [1.0] * 6  # 0 + 1: the second reducer works once the first is done


@pytest.mark.timeout(JOB + 60)
def test_a_rank_outside_a_subgroup_gets_a_clear_error():
    res = run_workers(3, tw.non_member, TIMEOUT, timeout=JOB, pg_timeout=PG_TIMEOUT)
    for what in ("transport", "reducer", "onebit"):
        status, exc, msg, _ = res[2][what]
        assert status == "error" and exc == "ValueError", (what, res[2][what])
        assert "not a member" in msg and "global rank 2" in msg, msg
    want = [float(2 * i + 10) for i in range(8)]  # (i) + (i + 10)
    for r in range(2):
        assert res[r] == {"rank": r, "size": 2, "sum": want}
