"""``gtopk-bench half-precision`` (gtopk_plugin/bench/half_precision.py): the demo
model with fp32, fp16 and bf16 gradients on real gloo workers, a few steps,
and the invariants of its JSON (finite state, no error, mass conserved to
1e-5 against the workers' float64 sums, replicas that agree); and the
verdict's logic on synthetic records (it must be able to fail).  The full
2,000-step run's figures are in docs/results.md."""
import json

import pytest

from gtopk_plugin.bench import half_precision as hp
STEPS = 20


@pytest.mark.timeout(420)
def test_half_precision_quick_run_conserves_mass_and_stays_finite(tmp_path):
    path = str(tmp_path / "half_precision.json")
    argv = ["--workers", "2", "--steps", str(STEPS), "--check-every", "5", "--json", path, "--silent"]
    assert hp.main(argv) == 0
    with open(path) as f:
        doc = json.load(f)
    assert doc["benchmark"] == "half_precision" and doc["settings"]["workers"] == 2
    runs = doc["results"]["runs"]
    assert sorted((r["method"], r["dtype"]) for r in runs) == sorted(
        (m, d) for m in hp.METHODS for d in hp.DTYPES)
    grad_dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
    for r in runs:
        name = (r["method"], r["dtype"])
        assert r["grad_dtype"] == grad_dtype[r["dtype"]], name
        assert r["steps"] == STEPS and r["error"] is None, (name, r["error"])
        assert r["first_nonfinite_step"] is None and r["first_nonfinite_grad_step"] is None, name
        # error-feedback state in float32 whatever the gradients' dtype
        assert r["residual_dtypes"] == ["float32"], name
        assert [p[0] for p in r["curve"]] == [5, 10, 15, 20], name
        assert all(0 <= e <= 1e-5 for _, e in r["curve"]), (name, r["curve"])
        assert r["rel_conservation_error"] == r["curve"][-1][1]
        assert r["ranks_agree"] and r["models_agree"], name
        assert r["residual_max_abs"] > 0, name  # something was held back: the check is not vacuous
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["ok"], name
    gaps = doc["results"]["accuracy_gap_pp"]
    for m in hp.METHODS:
        acc = {r["dtype"]: r["test_accuracy"] for r in runs if r["method"] == m}
        assert gaps[m]["bf16_minus_fp32_pp"] == pytest.approx(100 * (acc["bf16"] - acc["fp32"]), abs=1e-3)


def _record(method="gtopk", dtype="bf16", err=1e-7, nonfinite=None, error=None, agree=True, steps=10,
            bad_grad=None):
    return {"method": method, "dtype": dtype, "model_dtype": "bfloat16", "grad_dtype": "bfloat16",
            "steps": steps, "test_accuracy": 0.5, "final_loss": 1.0, "residual_dtypes": ["float32"],
            "curve": [{"step": steps, "rel_error": err, "ranks_agree": agree}],
            "final": {"step": steps, "rel_error": err, "ranks_agree": agree},
            "first_nonfinite_step": nonfinite, "first_nonfinite_grad_step": bad_grad, "error": error,
            "residual_max_abs": 1.0,
            "update_max_abs_last": 1.0, "models_agree": True, "wall_s": 1.0}


def test_verdict_catches_each_broken_invariant():
    class Args:
        steps, tolerance, methods = 10, 1e-5, ["gtopk"]

    cases = {
        "fine": _record(),
        "conservation": _record(err=2e-5),
        "nan": _record(err=float("nan")),
        "nonfinite": _record(nonfinite=7),
        "raised": _record(error={"step": 3, "type": "NonFiniteStateError", "message": "boom"}),
        "disagree": _record(agree=False),
        "diverged": _record(steps=4, bad_grad=4,
                            error={"step": 4, "type": "NonFiniteGradientError", "message": "inf"}),
        "short": _record(steps=9),
    }
    for name, rec in cases.items():
        # rank 1 is fine, rank 0 carries the defect (and vice versa for non-finite state)
        per_rank = [[rec], [_record(steps=rec["steps"])]]
        if name == "nonfinite":
            per_rank.reverse()
        summary = hp.summarise(per_rank, Args)
        row = summary["runs"][0]
        bad = hp.failures(summary, Args.tolerance)
        assert row["ok"] == (name == "fine"), name
        assert len(bad) == (0 if name == "fine" else 1), (name, bad)
    assert "non-finite update or residual from step 7" in hp.failures(
        hp.summarise([[_record()], [_record(nonfinite=7)]], Args), 1e-5)[0]
    assert "diverged" in hp.failures(hp.summarise([[_record(bad_grad=3)], [_record()]], Args), 1e-5)[0]
