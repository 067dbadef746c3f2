"""The convergence study's CI configuration (``--quick``): every method
trains (the evaluation loss falls) on all three tasks, and the JSON, PNG and
markdown outputs are written.  Accuracy is not checked here: the full study
(``python -m lab.convergence``, lab/reports/convergence.md) reports it."""
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from lab.convergence import cli, sim, study  # noqa: E402


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
    assert sim.bytes_per_worker("butterfly", 8, 10_000, 100) == 3 * 8 * 100
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


# ------------------------------------------------------------ momentum group
def test_momentum_modes_use_the_library_correction():
    """Modes "corr"/"dgc" hand momentum, Nesterov and masking to the reducer
    (no private copy in the simulator); the optimizer then has no momentum.
    Dense keeps momentum in the optimizer."""
    steps = 100
    s = sim.RunSpec(task="digits", method="gtopk", momentum=0.9, momentum_mode="dgc", nesterov=True,
                    clip_norm=2.0, warmup_epochs=1.0)
    kw = sim.reducer_kwargs(s, steps, steps_per_epoch=22)
    assert kw["momentum_correction"] == 0.9 and kw["nesterov"] is True and kw["momentum_masking"] is True
    assert kw["clip_norm"] == 2.0 and kw["warmup"].steps == 22 and kw["warmup"].start_density == 0.25
    assert sim.optimizer_momentum(s) == 0.0
    corr = sim.reducer_kwargs(sim.RunSpec(task="digits", method="topk", momentum=0.9, momentum_mode="corr"), steps, 22)
    assert corr["momentum_masking"] is False
    assert "momentum_correction" not in sim.reducer_kwargs(sim.RunSpec(task="digits", method="topk", momentum=0.9,
                                                            momentum_mode="opt"), steps, 22)
    dense = sim.RunSpec(task="digits", method="dense", momentum=0.9, momentum_mode="dgc", nesterov=True)
    assert "momentum_correction" not in sim.reducer_kwargs(dense, steps, 22)
    import torch
    opt = sim.make_optimizer(dense, [torch.zeros(3, requires_grad=True)], 0.1)
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["nesterov"]
    adamw = sim.RunSpec(task="digits", method="gtopk", optimizer="adamw", weight_decay=0.01)
    assert isinstance(sim.make_optimizer(adamw, [torch.zeros(3, requires_grad=True)], 1e-3), torch.optim.AdamW)
    with pytest.raises(ValueError, match="AdamW"):
        sim.RunSpec(task="digits", method="gtopk", optimizer="adamw", momentum=0.9, momentum_mode="dgc")


def test_dgc_mode_equals_an_independent_velocity():
    """One simulated step of mode "corr" on digits equals feeding each
    worker's own velocity u = m·u + g (computed here, outside the library)
    to a reducer without momentum, over three steps."""
    import torch
    from gtopk_plugin.testing import Oracle

    from lab.convergence import tasks

    task = tasks.get("digits")
    spec = sim.RunSpec(task="digits", method="topk", density=0.05, workers=3, momentum=0.9,
                       momentum_mode="corr", steps=3, lr=0.05)
    out = sim.run(task, spec, keep_params=True)
    # the same three steps by hand
    model = sim.initial_model(task, 0)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    plain = Oracle(3, method="topk", density=0.05, seed=0, kernels="reference")
    vel = [[torch.zeros_like(p) for p in params] for _ in range(3)]
    for step in range(3):
        batch = task.batch_indices(0, step, task.batch_size)
        grads = []
        for r in range(3):
            _, g = sim.worker_gradients(task, model, params, batch, r, 3)
            for u, gi in zip(vel[r], g):
                u.mul_(0.9).add_(gi)
            grads.append({n: u.clone() for n, u in zip(names, vel[r])})
        upd = plain.step(grads)
        with torch.no_grad():
            for n, p in zip(names, params):
                p -= 0.05 * upd[n]
    # without masking the velocities are never reset, so the two agree to rounding
    ref = torch.cat([p.detach().reshape(-1) for p in params])
    assert torch.allclose(out["params"], ref, atol=1e-6, rtol=1e-5)


def test_batchnorm_running_stats_are_rank0s():
    """glyphs_resnet: after a simulated step the BatchNorm running statistics
    are those rank 0's shard alone produces (DDP's broadcast_buffers), not
    the result of all P simulated forwards on the shared model."""
    import torch

    from lab.convergence import tasks

    task = tasks.get("glyphs_resnet")
    spec = sim.RunSpec(task="glyphs_resnet", method="gtopk", workers=4, steps=1)
    batch = task.batch_indices(0, 0, task.batch_size)
    model = sim.initial_model(task, 0)
    task.loss(model, task.shard(batch, 0, 4))  # rank 0's forward only
    expect = [b.clone() for b in model.buffers()]
    out = sim.run(task, spec, keep_params=True)
    assert len(out["buffers"]) == len(expect) > 0
    for a, b in zip(expect, out["buffers"]):
        assert torch.equal(a, b)
    # another shard gives other statistics, so the check can fail
    m1 = sim.initial_model(task, 0)
    task.loss(m1, task.shard(batch, 1, 4))
    assert not all(torch.equal(a, b) for a, b in zip(expect, m1.buffers()))


@pytest.fixture(scope="module")
def momentum_quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("mom") / "mq.json"
    rc = cli.main(["--group", "momentum", "--quick", "--steps", "8", "--json", str(out), "--jobs", "1",
                   "--no-progress"])
    assert rc == 0
    return out, json.loads(out.read_text())


def test_momentum_group_quick(momentum_quick):
    path, res = momentum_quick
    assert {"meta", "goals", "summary"} <= set(res)
    text = path.read_text()
    assert "\n" not in text.strip(), "the momentum JSON is compact (no indentation)"
    variants = {(r["task"], r["method"], r["variant"]) for r in res["summary"]}
    for v in ("recipe", "opt", "nesterov", "adamw", "clip"):
        assert ("digits", "gtopk", v) in variants, v
    assert ("glyphs_resnet", "gtopk", "recipe") in variants
    for r in res["summary"]:
        assert not r["diverged"], r
        assert len(r["curve"]["step"]) <= 24
    g = res["goals"][0]
    assert g["task"] == "digits" and g["unit"] == "pp" and "holds" in g
    assert os.path.getsize(str(path).replace(".json", ".png")) > 0


# -------------------------------------------------------------- codecs group
@pytest.fixture(scope="module")
def codecs_quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("codecs") / "cq.json"
    rc = cli.main(["--group", "codecs", "--quick", "--steps", "6", "--json", str(out), "--jobs", "1",
                   "--no-progress"])
    assert rc == 0
    return out, json.loads(out.read_text())


def test_codecs_group_quick(codecs_quick):
    """onebit, powersgd(r=4) and qsgd, both momentum modes, simulated by
    GradientReducer ranks on threads; their bytes are the reducers' own
    counters: onebit's are (P−1)·(⌈N/8⌉ + 4·tensors) exactly."""
    from lab.convergence import tasks

    path, res = codecs_quick
    rows = {(r["label"], r["mode"]): r for r in res["summary"]}
    for label in ("onebit", "powersgd(r=4)", "qsgd"):
        for mode in ("warm", "corr", "opt"):
            assert (label, mode) in rows, (label, mode)
    for r in res["summary"]:
        assert not r["diverged"] and r["total_bytes"] > 0, r["label"]
    params = list(tasks.get("digits").build_model().parameters())
    n = sum(p.numel() for p in params)
    assert rows[("onebit", "corr")]["bytes_per_step"] == 3 * (-(-n // 8) + 4 * len(params))
    dense = rows[("dense", "dense")]["bytes_per_step"]
    assert rows[("powersgd(r=4)", "corr")]["bytes_per_step"] < 0.2 * dense
    for label in ("onebit", "powersgd(r=4)", "qsgd"):  # 6 steps inside the dense warm-up
        assert rows[(label, "warm")]["bytes_per_step"] == dense
    assert {(g["method"], g["mode"]) for g in res["goals"]} >= {("onebit", "corr"), ("powersgd(r=4)", "corr")}
    assert res["bytes_to_accuracy"]
    assert os.path.getsize(str(path).replace(".json", ".png")) > 0


def test_momentum_long_budgets_reach_the_grid():
    """``--long``: every recipe run of a task gets LONG_BUDGET's steps and
    warm-up epochs (the short budget's otherwise)."""
    from lab.convergence import momentum as mom

    steps = {t: b["steps"] for t, b in mom.LONG_BUDGET.items()}
    warmup = {t: b["warmup_epochs"] for t, b in mom.LONG_BUDGET.items()}
    recipes = {t: b["recipe"] for t, b in mom.LONG_BUDGET.items()}
    g = mom.grid((0,), ("glyphs", "charlm"), resnet=True, steps=steps, warmup=warmup, recipes=recipes)
    for grp, s in g:
        assert s.steps == mom.LONG_BUDGET[s.task]["steps"], (grp, s)
        if grp in ("recipe", "resnet") and s.method != "dense":  # (canonical dense specs carry none)
            assert s.warmup_epochs == mom.LONG_BUDGET[s.task]["warmup_epochs"], (grp, s)
            # the long recipe: rTop-k keeps k of the top 2k; the LSTM without masking
            assert s.r_factor == (2.0 if s.method == "rtopk" else 4.0), s
            assert s.momentum_mode == ("corr" if s.task == "charlm" else "dgc"), s
        # every run is labelled with the variant that made it (the markdown
        # tables select rows by it), long budgets included
        assert mom.variant_of(s) != "?", s
    short = mom.grid((0,), ("glyphs", "charlm"), resnet=False)
    assert {s.steps for _, s in short if s.task == "glyphs"} == {mom.BUDGET["glyphs"]["steps"]}
    # the short budget keeps the plain recipe (masking, r = 4)
    assert {(s.momentum_mode, s.r_factor) for grp, s in short if grp == "recipe" and s.method == "rtopk"} == \
        {("dgc", 4.0)}
