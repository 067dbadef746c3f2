"""``gtopk-bench fp16-allreduce`` on real jobs (Horovod's gloo controller and
torch.distributed's gloo, one network namespace per rank): every allreduce's
result matches the float64 sum of the ranks' tensors, to each dtype's
precision, and the table and JSON are written.  Times are not asserted."""
import json
import os

import pytest

from hvd_launch import require_horovod  # noqa: E402

require_horovod()

from benchmarks import fp16_allreduce  # noqa: E402
from benchmarks.cluster import netns  # noqa: E402

NETNS_OK, NETNS_WHY = netns.available()


@pytest.mark.skipif(not NETNS_OK, reason=f"NETNS TESTS SKIPPED: {NETNS_WHY}")
@pytest.mark.timeout(300)
def test_both_engines_sum_fp32_and_fp16_against_the_float64_oracle(tmp_path):
    out = os.path.join(tmp_path, "fp16.json")
    before = set(netns.list_namespaces())
    rc = fp16_allreduce.main(["-P", "3", "--numel", "5000", "--reps", "2", "--rate", "1gbit", "--json", out])
    assert rc == 0
    assert set(netns.list_namespaces()) <= before  # the cluster was taken down
    rows = json.load(open(out))["results"]
    assert sorted((r["engine"], r["dtype"]) for r in rows) == sorted(
        (e, d) for e in ("horovod", "torch") for d in ("float32", "float16"))
    for r in rows:
        # three ranks' N(0, 1) values: fp32 rounds the sum at ~1e-7, fp16
        # rounds inputs and partial sums at ~5e-4 of their size
        assert r["rel_err"] < (1e-6 if r["dtype"] == "float32" else 5e-3), r
        assert r["MB"] == pytest.approx(5000 * (4 if r["dtype"] == "float32" else 2) / 1e6)
        assert r["wall_ms"] > 0 and r["cpu_ms_per_rank"] >= 0


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        fp16_allreduce.main(["-P", "1"])
