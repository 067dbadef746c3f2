"""The Horovod benchmarks that run real jobs on namespaced links (Horovod's
gloo controller, one network namespace per rank), each short, checked
against independent accounts; no time is asserted.

- ``python -m lab horovod-idle``: Horovod's background loop sends
  coordination traffic every cycle even when no op is in flight, and
  ``HOROVOD_CYCLE_TIME`` scales it (the advice of docs/horovod.md for sparse
  jobs on slow links), checked on the interfaces' own byte counters.
- ``python -m lab fp16-allreduce``: Horovod's and torch.distributed's gloo
  allreduce in fp32 and fp16, each result against the float64 sum of the
  ranks' tensors."""
import json
import os

import pytest

from hvd_launch import require_horovod  # noqa: E402

require_horovod()

from lab import fp16_allreduce, horovod_idle  # noqa: E402
from lab.cluster import netns  # noqa: E402
from netns_marks import needs_netns  # noqa: E402


def bench_rows(bench, args, tmp_path):
    """Run ``bench.main(args + --json)``; it must succeed and take its
    namespaces down; returns the JSON's rows."""
    out = os.path.join(tmp_path, "bench.json")
    before = set(netns.list_namespaces())
    assert bench.main(list(args) + ["--json", out]) == 0
    assert set(netns.list_namespaces()) <= before  # the cluster was taken down
    return json.load(open(out))["results"]


@needs_netns
@pytest.mark.timeout(300)
def test_idle_traffic_falls_with_the_cycle_time_and_each_job_sees_its_cycle(tmp_path):
    rows = bench_rows(horovod_idle, ["-P", "2", "--rates", "1gbit", "--cycles", "default,20", "--idle-s", "1.5",
                                     "--ops", "3"], tmp_path)
    assert [(r["cycle_ms"], r["cycle_seen"]) for r in rows] == [("default", None), (20.0, "20")]
    fast, slow = rows[0]["idle_bytes_per_s"], rows[1]["idle_bytes_per_s"]
    assert len(fast) == len(slow) == 2
    # every rank sends while idle; a 20x longer cycle sends far less (one
    # coordination per cycle; > 2x leaves room for a loaded machine, where
    # the 1 ms loop runs slower than asked)
    assert min(fast) > 0 and min(slow) > 0
    assert min(fast) > 2 * max(slow), (fast, slow)
    assert all(r["join_ms"] > 0 and r["allreduce_ms"] > 0 for r in rows)


@needs_netns
@pytest.mark.timeout(300)
def test_fp16_allreduce_both_engines_sum_fp32_and_fp16_against_the_float64_oracle(tmp_path):
    rows = bench_rows(fp16_allreduce, ["-P", "3", "--numel", "5000", "--reps", "2", "--rate", "1gbit"], tmp_path)
    assert sorted((r["engine"], r["dtype"]) for r in rows) == sorted(
        (e, d) for e in ("horovod", "torch") for d in ("float32", "float16"))
    for r in rows:
        # three ranks' N(0, 1) values: fp32 rounds the sum at ~1e-7, fp16
        # rounds inputs and partial sums at ~5e-4 of their size
        assert r["rel_err"] < (1e-6 if r["dtype"] == "float32" else 5e-3), r
        assert r["MB"] == pytest.approx(5000 * (4 if r["dtype"] == "float32" else 2) / 1e6)
        assert r["wall_ms"] > 0 and r["cpu_ms_per_rank"] >= 0


def test_fp16_allreduce_refuses_bad_arguments():
    with pytest.raises(SystemExit):
        fp16_allreduce.main(["-P", "1"])
