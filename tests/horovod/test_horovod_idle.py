"""Horovod's background loop sends coordination traffic every cycle even when
no op is in flight, and ``HOROVOD_CYCLE_TIME`` scales it (the advice of
docs/horovod.md for sparse jobs on slow links): ``gtopk-bench horovod-idle``
on real Horovod jobs (gloo controller, one network namespace per rank),
checked on the interfaces' own byte counters."""
import json
import os

import pytest

from hvd_launch import require_horovod  # noqa: E402

require_horovod()

from benchmarks import horovod_idle  # noqa: E402
from benchmarks.cluster import netns  # noqa: E402

NETNS_OK, NETNS_WHY = netns.available()


@pytest.mark.skipif(not NETNS_OK, reason=f"NETNS TESTS SKIPPED: {NETNS_WHY}")
@pytest.mark.timeout(300)
def test_idle_traffic_falls_with_the_cycle_time_and_each_job_sees_its_cycle(tmp_path):
    out = os.path.join(tmp_path, "idle.json")
    before = set(netns.list_namespaces())
    rc = horovod_idle.main(["-P", "2", "--rates", "1gbit", "--cycles", "default,20", "--idle-s", "1.5",
                            "--ops", "3", "--json", out])
    assert rc == 0
    assert set(netns.list_namespaces()) <= before  # the cluster was taken down
    rows = json.load(open(out))["results"]
    assert [(r["cycle_ms"], r["cycle_seen"]) for r in rows] == [("default", None), (20.0, "20")]
    fast, slow = rows[0]["idle_bytes_per_s"], rows[1]["idle_bytes_per_s"]
    assert len(fast) == len(slow) == 2
    # every rank sends while idle; a 20x longer cycle sends far less (one
    # coordination per cycle; > 2x leaves room for a loaded machine, where
    # the 1 ms loop runs slower than asked)
    assert min(fast) > 0 and min(slow) > 0
    assert min(fast) > 2 * max(slow), (fast, slow)
    assert all(r["join_ms"] > 0 and r["allreduce_ms"] > 0 for r in rows)
