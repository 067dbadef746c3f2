"""Smoke test of the elastic-scheduler benchmark (``lab/elastic.py``):
``--quick`` runs, writes its JSON, table and plot, and has a row
for every policy and reducer.  Shaped network namespaces when they work,
else plain loopback labelled 'unshaped' (as tests/distributed/test_cluster.py does).  No
test asserts on a timing."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from lab import elastic  # noqa: E402
from lab.cluster import netns  # noqa: E402
from netns_marks import NETNS_OK  # noqa: E402


def test_parse_policies():
    got = elastic.parse_policies("barrier, norm:0.3,norm,variance,variance:2")
    assert [(p["policy"], p["beta"], p["variance_factor"]) for p in got] == [
        ("barrier", None, None), ("norm", 0.3, None), ("norm", 0.5, None), ("variance", None, 1.0),
        ("variance", None, 2.0)]
    with pytest.raises(ValueError):
        elastic.parse_policies("norm:1.5")
    with pytest.raises(ValueError):
        elastic.parse_policies("sometimes")


def test_model_layers_are_convolutions_and_the_classifier():
    info = elastic.model_info(16, 3)
    assert info["layers"] == 1 + 2 * 3 + 1
    assert sum(info["layer_numel"]) == info["parameters"]


def test_quick_run_writes_json_with_every_policy(tmp_path):
    out = str(tmp_path / "elastic.json")
    argv = ["--quick", "--json", out, "--quiet", "--timeout", "300"]
    if not NETNS_OK:
        argv.append("--no-netns")
    assert elastic.main(argv) == 0
    res = json.load(open(out))
    assert res["meta"]["network"]["shaped"] == NETNS_OK
    want = {(r, p["name"]) for r in ("dense", "gtopk") for p in elastic.parse_policies(elastic.DEFAULT_POLICIES)}
    assert {(r["reducer"], r["name"]) for r in res["rows"]} == want
    assert {(r["reducer"], r["name"]) for r in res["summary"]} == want
    for r in res["rows"]:
        assert r["label"] == ("shaped" if NETNS_OK else "unshaped")
        assert len(r["step_times_s"]) == res["meta"]["settings"]["steps"]
        assert 0.0 <= r["accuracy"] <= 1.0
        # dense and gTop-k reductions are deterministic: every rank ends with the same weights
        assert r["params_equal_across_ranks"], r["name"]
        stale = {int(k): v for k, v in r["stats_rank0"]["staleness"].items()}
        assert max(stale) <= 1  # max_staleness = 1 holds
        if r["policy"] == "barrier":
            assert set(stale) == {0} and r["stats_rank0"]["barrier_breaks"] == 0
    assert os.path.exists(os.path.splitext(out)[0] + ".md")
    pytest.importorskip("matplotlib")
    assert os.path.exists(os.path.splitext(out)[0] + ".png")
    if NETNS_OK:  # every namespace this process created is gone (other runs' may come and go)
        assert [n for n in netns.list_namespaces() if n.startswith(f"{netns.PREFIX}-{os.getpid()}-")] == []
