"""The one process launcher (gtopk_plugin/launch.py): real ranks in a gloo
group, results by rank, the first failure stops the job and names its
cause, a deadline, captured output and progress, the raise_errors=False
report of every rank."""
import time

import pytest
import torch
import torch.distributed as dist

from gtopk_plugin._launch import launcher as launch


def allreduce_rank(ctx, tag):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    ctx.progress(rank=ctx.rank, tag=tag)
    print(f"hello from rank {ctx.rank}")
    return {"rank": ctx.rank, "size": ctx.size, "tag": tag, "sum": t.item()}


def one_rank_raises(ctx, bad):
    if ctx.rank == bad:
        raise ValueError(f"rank {bad} fails on purpose")
    dist.all_reduce(torch.zeros(1))  # the others wait for the failed rank
    time.sleep(60)
    return "unreachable"


def sleeps(ctx):
    time.sleep(60)


def no_group(ctx):
    return (ctx.engine, dist.is_initialized())


@pytest.mark.timeout(120)
def test_results_by_rank_over_a_real_gloo_group():
    res = launch.run(3, allreduce_rank, "x", timeout=90)
    assert [r["rank"] for r in res] == [0, 1, 2]
    assert all(r["size"] == 3 and r["tag"] == "x" and r["sum"] == 3.0 for r in res)


@pytest.mark.timeout(120)
def test_captured_output_and_progress_from_rank_0():
    seen = []
    res = launch.run(2, allreduce_rank, "y", timeout=90, output="capture",
                     progress=lambda rank, msg: seen.append((rank, msg)))
    assert [r["sum"] for r in res] == [1.0, 1.0]
    assert seen == [(0, {"rank": 0, "tag": "y"})]


@pytest.mark.timeout(120)
def test_first_failure_stops_every_rank_and_is_named():
    t0 = time.monotonic()
    with pytest.raises(launch.WorkerError) as exc:
        launch.run(3, one_rank_raises, 1, timeout=90)
    assert time.monotonic() - t0 < 60  # not the sleeping ranks' 60 s, nor the deadline
    e = exc.value
    assert e.rank == 1 and e.exc_type == "ValueError" and "fails on purpose" in e.message
    assert "worker rank 1 failed" in str(e) and "all workers were killed" in str(e)


@pytest.mark.timeout(120)
def test_without_raise_errors_every_rank_reports():
    res = launch.run(2, one_rank_raises, 0, timeout=90, pg_timeout=5, fail_fast=False,
                     raise_errors=False)
    assert res[0][0] == "error" and res[0][1][0] == "ValueError"
    assert res[1][0] == "error"  # its peer died under it: a gloo error, not a hang


@pytest.mark.timeout(60)
def test_deadline_kills_the_job():
    t0 = time.monotonic()
    with pytest.raises(launch.LaunchTimeout, match="timed out after 2 s"):
        launch.run(2, sleeps, timeout=2)
    assert time.monotonic() - t0 < 30
    assert issubclass(launch.LaunchTimeout, TimeoutError)


@pytest.mark.timeout(60)
def test_engine_none_joins_no_group():
    assert launch.run(2, no_group, engine="none", timeout=60) == [("none", False)] * 2


def test_target_names_round_trip():
    name = launch.target_name(allreduce_rank)
    assert name.endswith(":allreduce_rank")
    assert launch.resolve_target(name) is allreduce_rank
    with pytest.raises(ValueError):
        launch.run(0, allreduce_rank)
