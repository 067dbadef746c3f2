"""python -m lab train-report (lab/train/combine.py): rows of several
train JSONs joined into one group, targets and ratios recomputed against the
baseline another file holds -- checked against hand-computed values."""
import json

from lab.train import combine


def row(method, seed, final, curve, engine="ddp", policy=None, name=None):
    return {"workload": "vgg", "rate_label": "paper", "seed": seed, "engine": engine, "method": method,
            "density": 0.01, "policy": policy, "beta": None, "cycle_ms": None, "name": name or method,
            "final_accuracy": final, "curve": [{"step": 50 * (i + 1), "wall_s": t, "accuracy": a}
                                               for i, (t, a) in enumerate(curve)],
            "wall_s": 1.0, "bytes_per_step": 1.0, "tx_bytes_per_step": 1.0, "step_s": 0.1,
            "compute_s": 0.05, "comm_wait_s": 0.05, "step_cpu_s": 0.01, "params_equal": True}


def test_join_uses_the_other_files_baseline_and_replaces_duplicates(tmp_path, capsys):
    first = {"rows": [row("dense", 1, 0.90, [(10.0, 0.50), (20.0, 0.88), (30.0, 0.90)]),
                      row("topk", 1, 0.895, [(4.0, 0.70), (8.0, 0.895)]),
                      row("threshold", 1, 0.85, [(5.0, 0.85)], name="old threshold"),
                      row("dense", 0, 0.95, [(1.0, 0.95)])]}
    second = {"rows": [row("threshold", 1, 0.89, [(2.0, 0.80), (5.0, 0.89)], name="new threshold"),
                       row("rtopk", 1, 0.80, [(3.0, 0.80)])]}
    paths = []
    for i, doc in enumerate((first, second)):
        p = tmp_path / f"{i}.json"
        p.write_text(json.dumps(doc))
        paths.append(str(p))
    assert combine.main(paths + ["--seeds", "1", "--md", str(tmp_path / "t.md")]) == 0
    err = capsys.readouterr().err
    assert "replaces the row 'new threshold'" in err
    rows = combine.join([first, second], seeds=[1])
    by = {r["method"]: r for r in rows}
    assert set(by) == {"dense", "topk", "threshold", "rtopk"}  # seed 0 left out, one threshold row
    assert by["threshold"]["name"] == "new threshold"
    # target = dense final 0.90 - 1 pp = 0.89: dense first reaches it at 30 s, Top-k at 8 s
    assert abs(by["threshold"]["target"] - 0.89) < 1e-12
    assert by["dense"]["time_to_target_s"] == 30.0
    assert by["threshold"]["time_to_target_s"] == 5.0
    assert abs(by["threshold"]["speedup_vs_baseline"] - 6.0) < 1e-12
    assert abs(by["threshold"]["speedup_vs_topk"] - 8.0 / 5.0) < 1e-12
    assert by["rtopk"]["time_to_target_s"] is None
    # the inputs are untouched (rows are copies)
    assert "target" not in second["rows"][0]
    assert "not reached" in (tmp_path / "t.md").read_text()
