"""End-to-end tests of ``gtopk-demo`` (gtopk_plugin/demo.py): real worker
processes on a gloo group, the JSON report, argument errors, and that a
failing or slow worker ends the demo with a non-zero status instead of a hang."""
import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("tqdm")

from gtopk_plugin import demo  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_demo(*args, timeout=150):
    env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gtopk_plugin.demo", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


@pytest.mark.timeout(180)
def test_demo_trains_and_reports_json(tmp_path):
    out = tmp_path / "demo.json"
    # Two epochs rather than one: still a few seconds, and a wide margin over
    # the accuracy bound below on any platform's float rounding.
    proc, _ = run_demo("--workers", "2", "--epochs", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test accuracy" in proc.stdout and "bytes sent/step/worker" in proc.stdout
    # the workers leave through os._exit: nothing they created may be left to
    # the resource tracker (tqdm's multiprocessing lock used to be)
    assert "leaked semaphore" not in proc.stderr and "resource_tracker" not in proc.stderr, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["workers"] == 2 and report["epochs"] == 2
    res = report["results"]
    assert set(res) == {"dense", "gtopk"}
    dense, gtopk = res["dense"], res["gtopk"]
    # the default recipe: DGC momentum correction for the sparse run only,
    # cosine learning rate
    assert gtopk["momentum_correction"] is True and dense["momentum_correction"] is False
    assert report["lr_schedule"] == "cosine"
    assert gtopk["bytes_per_step_per_worker"] < dense["bytes_per_step_per_worker"]
    # Dense traffic is the ring-allreduce figure; gTop-k with P=2 is one round
    # of k entries of 8 bytes per layer (docs/design.md §2), about 10% of it here.
    assert dense["bytes_per_step_per_worker"] == pytest.approx(dense["dense_bytes_per_step_per_worker"])
    assert gtopk["bytes_per_step_per_worker"] < 0.2 * dense["bytes_per_step_per_worker"]
    for r in (dense, gtopk):
        assert r["test_accuracy"] > 0.5, r  # 10 classes: chance is 0.1
        assert r["steps"] > 0 and r["total_bytes"] > 0 and r["wall_time_s"] > 0
        assert len(r["history"]) == 2


@pytest.mark.parametrize("argv, message", [
    (["--method", "bogus"], "invalid choice: 'bogus'"),
    (["--density", "2"], "density must be in (0, 1]"),
    (["--density", "0"], "density must be in (0, 1]"),
    (["--density", "nan"], "density must be in (0, 1]"),
    (["--workers", "0"], "--workers: expected a positive int"),
    (["--epochs", "-1"], "--epochs: expected a positive int"),
    (["--workers", "4", "--batch-size", "2"], "--batch-size (2) must be at least --workers (4)"),
    (["--workers", "2", "--fail-rank", "2"], "--fail-rank must be in [0, 1]"),
    (["--json", os.path.join(os.sep, "no-such-dir-gtopk", "out.json")], "does not exist"),
    (["--warmup-epochs", "-1"], "--warmup-epochs must be in [0, --epochs]"),
    (["--epochs", "2", "--warmup-epochs", "3"], "--warmup-epochs must be in [0, --epochs]"),
    (["--lr-schedule", "step"], "invalid choice: 'step'"),
])
def test_bad_arguments_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code != 0
    assert message in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_bad_argument_exit_status_from_command_line():
    proc, _ = run_demo("--method", "bogus", timeout=50)
    assert proc.returncode != 0
    assert "invalid choice: 'bogus'" in proc.stderr


@pytest.mark.timeout(180)
def test_failing_worker_makes_demo_exit_nonzero_without_hanging():
    # --fail-rank is a hidden, test-only option: that rank raises at step 1.
    proc, elapsed = run_demo("--workers", "2", "--epochs", "1", "--fail-rank", "1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "worker rank 1 failed" in proc.stderr
    assert "fails on purpose at step 1" in proc.stderr
    assert "all workers were killed" in proc.stderr
    # Rank 0 is left waiting in a collective; the launcher must not wait for
    # the transport's own timeout (minutes) before giving up.
    assert elapsed < 120


@pytest.mark.timeout(120)
def test_timeout_kills_workers_and_exits_nonzero():
    proc, elapsed = run_demo("--workers", "2", "--timeout", "1", timeout=100)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "timed out after 1 s" in proc.stderr
    assert elapsed < 90


def test_recipe_helpers():
    """Warm-up as the reducer's one argument, the cosine schedule, and when
    the correction is on."""
    args = demo.parse_args(["--warmup-epochs", "1"])
    assert demo.warmup_schedule("gtopk", demo.parse_args([]), 44) is None  # off by default
    w = demo.warmup_schedule("gtopk", args, 44)
    assert w.steps == round(args.warmup_epochs * 44) and w.start_density == demo.WARMUP_START
    assert w.density(0, args.density) == demo.WARMUP_START and w.density(w.steps, args.density) == args.density
    assert demo.warmup_schedule("dense", args, 44) is None
    assert demo.warmup_schedule("gtopk", demo.parse_args(["--warmup-epochs", "0"]), 44) is None
    assert demo.lr_at(args, 0, 100) == args.lr and abs(demo.lr_at(args, 50, 100) - args.lr / 2) < 1e-12
    assert demo.lr_at(demo.parse_args(["--lr-schedule", "const"]), 99, 100) == args.lr
    assert demo.uses_momentum_correction("gtopk", args) and not demo.uses_momentum_correction("dense", args)
    assert not demo.uses_momentum_correction("gtopk", demo.parse_args(["--no-momentum-correction"]))
    assert not demo.uses_momentum_correction("gtopk", demo.parse_args(["--momentum", "0"]))


def test_format_table_lists_every_method():
    rows = [{"method": m, "density": d, "test_accuracy": 0.95, "bytes_per_step_per_worker": b,
             "dense_bytes_per_step_per_worker": 1000.0, "total_bytes": 10 * b, "wall_time_s": 1.5}
            for m, d, b in (("dense", 1.0, 1000.0), ("gtopk", 0.05, 100.0))]
    table = demo.format_table(rows).splitlines()
    assert table[0].split(" | ")[0].strip() == "method"
    assert "wall time" in table[0] and "test accuracy" in table[0]
    assert table[2].startswith("dense") and table[3].startswith("gtopk")
    assert "10.00%" in table[3]  # gtopk's bytes relative to dense
