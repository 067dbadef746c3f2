"""``python -m lab soak`` (lab/soak.py): the quick mode end to end on
real gloo processes (P = 3, every method, 100 steps), the checks' logic on
synthetic samples (they must be able to fail), and the full 10,000-step run
behind the ``slow`` marker (``pytest -m slow``; its committed results are
lab/results/soak.json)."""
import json
import os

import pytest

from lab import soak
def _samples(rss, res, steps=1000, every=50):
    return [{"step": s, "rss": rss(s), "residual_norm": res(s), "loss": 1.0, "step_ms": 1.0}
            for s in range(every, steps + 1, every)]


def test_verdict_catches_memory_growth_and_unbounded_residuals():
    flat = soak.verdict(_samples(lambda s: 100e6, lambda s: 1.0), 1000, 0.05, 2.0)
    assert flat["rss_ok"] and flat["residual_ok"] and flat["rss_ref_step"] == 100
    leak = soak.verdict(_samples(lambda s: 100e6 + 10_000 * s, lambda s: 1.0), 1000, 0.05, 2.0)
    assert not leak["rss_ok"] and leak["rss_ratio"] == pytest.approx(110e6 / 101e6)
    grow = soak.verdict(_samples(lambda s: 100e6, lambda s: 1.0 + (s / 100) ** 2), 1000, 0.05, 2.0)
    assert grow["rss_ok"] and not grow["residual_ok"]
    nan = soak.verdict(_samples(lambda s: 100e6, lambda s: float("nan") if s == 900 else 1.0), 1000, 0.05, 2.0)
    assert not nan["residual_ok"]
    summary = {"topk": {"ranks": [leak, grow]}}
    msgs = soak.failures(summary)
    assert len(msgs) == 2 and "RSS" in msgs[0] and "residual" in msgs[1]


@pytest.mark.timeout(240)
def test_soak_quick_runs_every_method_at_P3(tmp_path):
    path = str(tmp_path / "soak.json")
    assert soak.main(["--quick", "--json", path, "--silent"]) == 0
    with open(path) as f:
        doc = json.load(f)
    assert doc["benchmark"] == "soak" and doc["settings"]["workers"] == 3 and doc["settings"]["steps"] == 100
    res = doc["results"]
    assert sorted(res) == sorted(soak.METHODS)
    for m, s in res.items():
        assert s["ok"] and len(s["ranks"]) == 3
        assert len(s["curve"]) <= doc["settings"]["curve_points"] and s["curve"][-1]["step"] == 100
        for v in s["ranks"]:
            assert v["rss_ok"] and v["residual_ok"]
            assert v["loss_last"] < v["loss_first"], f"{m} did not learn"
        if m == "dense":
            assert all(v["residual_norm_max_late"] == 0 for v in s["ranks"])
        else:
            assert all(v["residual_norm_last"] > 0 for v in s["ranks"])


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)
def test_soak_full_10k_steps(tmp_path):
    assert soak.main(["--json", str(tmp_path / "soak.json"), "--silent"]) == 0
