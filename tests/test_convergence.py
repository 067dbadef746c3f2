"""The convergence study's CI configuration (``--quick``): every method
trains (the evaluation loss falls) on all three tasks, and the JSON, PNG and
markdown outputs are written.  Accuracy is not checked here: the full study
(``python -m benchmarks.convergence``, docs/convergence.md) reports it."""
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from benchmarks.convergence import cli, sim, study  # noqa: E402


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "quick.json"
    rc = cli.main(["--quick", "--json", str(out), "--jobs", "1", "--no-progress", "--no-gloo"])
    assert rc == 0
    with open(out) as f:
        return out, json.load(f)


def test_every_method_reduces_the_loss(quick):
    _, res = quick
    runs = res["runs"]
    seen = {(r["task"], r["label"]) for r in runs if r["group"] == "main"}
    for t in study.ALL_TASKS:
        for m in ("dense", "topk", "gtopk", "rtopk(r=4)", "randomk", "threshold"):
            assert (t, m) in seen, f"{t} {m} missing from the quick run"
    for r in runs:
        assert not r["diverged"], r["spec"]
        assert math.isfinite(r["final_eval_loss"]), r["spec"]
        assert r["final_eval_loss"] < r["initial_eval_loss"], \
            f"{r['task']} {r['label']} ({r['group']}): eval loss {r['initial_eval_loss']:.4f} -> {r['final_eval_loss']:.4f}"
        assert r["total_bytes"] > 0


def test_outputs_written(quick):
    path, res = quick
    d, stem = os.path.dirname(path), os.path.splitext(os.path.basename(path))[0]
    for t in study.ALL_TASKS:
        assert os.path.getsize(os.path.join(d, f"{stem}_{t}.png")) > 0
    md = open(os.path.join(d, f"{stem}.md")).read()
    assert "gTop-k" in md and "digits" in md and "charlm" in md
    assert {"meta", "goals", "summary", "runs"} <= set(res)
    # bytes per worker per step follow the exact formulas
    by = {(r["task"], r["label"]): r["bytes_per_step"] for r in res["runs"] if r["group"] == "main"}
    n = next(r["numel"] for r in res["runs"] if r["task"] == "digits")
    assert by[("digits", "dense")] == (2 * 3 * 4 * n) // 4


def test_byte_formulas():
    assert sim.bytes_per_worker("gtopk", 8, 10_000, 100) == 3 * 8 * 100
    assert sim.bytes_per_worker("allgather", 8, 10_000, 100) == 7 * 8 * 100
    assert sim.bytes_per_worker("allgather", 4, 10_000, 100, counts=[90, 100, 110, 100]) == 3 / 4 * 8 * 400 + 8 * 3
    assert sim.bytes_per_worker("allreduce_values", 4, 10_000, 1001) == 6006
    assert sim.bytes_per_worker("dense", 4, 1_000_000, 0) == 6_000_000


def test_grid_is_deduplicated():
    grid = study.full_grid(seeds=(0,))
    specs = study.unique_specs(grid)
    assert len(specs) < len(grid)
    # dense appears once per (task, P, seed) in the main group whatever the density
    dense_main = {s for g, s in grid if g == "main" and s.method == "dense"}
    assert len(dense_main) == len(study.ALL_TASKS) * len(study.WORKERS)
