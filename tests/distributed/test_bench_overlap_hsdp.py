"""``gtopk-bench overlap`` and ``gtopk-bench hsdp-step`` end to end on
loopback (``--rate none``, one short round): every row runs, and the JSON
holds what the page and the goals are read from, checked against
invariants that do not come from the bench: the ranks end with the same
parameters, the synchronous and asynchronous hooks send the same bytes,
the exposed time is the step less the no-op step, and the replica
reduction's dense figure is stock HSDP's ring all-reduce of a shard.
The timed runs' figures are in docs/results.md."""
import json

import pytest

from gtopk_plugin.bench import hsdp_step, overlap_bench


@pytest.mark.timeout(300)
def test_overlap_quick_run_every_row_and_its_invariants(tmp_path):
    path = tmp_path / "overlap.json"
    assert overlap_bench.main(["--rate", "none", "--quick", "--out", str(path)]) == 0
    doc = json.loads(path.read_text())
    for table, P in (("overlap", 2), ("mlp", 4)):
        t = doc["results"][table]
        rows = t["rows"]
        assert t["P"] == P and not t["network"]["shaped"] and not t["not_run"]
        noop = rows["no-op hook (no communication)"]
        sparse = {n: r for n, r in rows.items() if n.startswith("sparse_hook")}
        assert {"allreduce_hook", "fp16_compress_hook"} <= set(rows) and len(sparse) >= 3
        for name, r in rows.items():
            if name != "no-op hook (no communication)":
                assert r["params_identical"], name  # every rank ends with the same parameters
            # the JSON keeps 6 significant digits
            assert r["exposed"] == pytest.approx(r["step"] - noop["step"], abs=1e-3), name
            assert r["x_noop"] == pytest.approx(r["step"] / noop["step"], rel=1e-4), name
        # overlap changes when the exchange runs, not what it sends
        assert len({r["bytes_sent"] for r in sparse.values()}) == 1 and next(iter(sparse.values()))["bytes_sent"] > 0


@pytest.mark.timeout(420)
def test_hsdp_step_quick_run_every_variant_and_the_dense_byte_count(tmp_path):
    path = tmp_path / "hsdp_step.json"
    assert hsdp_step.main(["--nodes", "2", "--rate", "none", "--rounds", "1", "--warmup", "0",
                           "--batch", "2", "--out", str(path)]) == 0
    doc = json.loads(path.read_text())
    (res,) = doc["results"]
    rows = res["rows"]
    assert res["nodes"] == 2 and res["local"] == 2 and "unshaped" in res["link"]
    assert set(rows) == set(hsdp_step.VARIANTS)
    n = res["params"]
    assert n == sum(a * b + b for a, b in zip(hsdp_step.WIDTHS[:-1], hsdp_step.WIDTHS[1:]))
    assert rows[hsdp_step.BASELINE]["vs_stock_per_round"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    for name, r in rows.items():
        pr = r["vs_stock_per_round"]
        assert 0 < pr["min"] <= pr["median"] <= pr["max"], name
        assert r["median_ms"] > 0 and r["vs_stock"] == pytest.approx(
            r["median_ms"] / rows[hsdp_step.BASELINE]["median_ms"], rel=1e-4), name  # 6 digits in the JSON
    for name in ("gtopk 1%", "gtopk 0.1%"):
        r = rows[name]
        # stock HSDP's ring all-reduce of each rank's half of the parameters
        # over 2 replicas: 2 (R - 1) / R x 4 bytes x N / 2
        assert r["replica_dense_bytes"] == 2 * n, name
        assert 0 < r["replica_bytes_sent"] < r["replica_dense_bytes"] / 20, name
    assert rows["gtopk 0.1%"]["replica_bytes_sent"] < rows["gtopk 1%"]["replica_bytes_sent"]
    for name in (hsdp_step.BASELINE, hsdp_step.FLOOR):
        assert rows[name]["replica_bytes_sent"] is None, name
