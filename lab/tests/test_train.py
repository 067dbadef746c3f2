"""``python -m lab train --quick``: real training jobs (DDP + the
comm hook, Horovod + the DistributedOptimizer, the elastic scheduler) on
the emulated cluster -- or on loopback, labelled unshaped, where network
namespaces cannot be made.  Asserts only that curves and files are written
and that the loss falls; never a timing."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from lab.cluster import cpu_account, harness, netns  # noqa: E402
from lab.train import report  # noqa: E402


def _row(method, accs, engine="ddp", policy=None, dt=1.0):
    curve = [{"step": i + 1, "wall_s": dt * (i + 1), "bytes": 0, "accuracy": a} for i, a in enumerate(accs)]
    return {"workload": "vgg", "rate_label": "1gbit", "seed": 0, "engine": engine, "method": method,
            "policy": policy, "name": method, "curve": curve, "final_accuracy": accs[-1], "wall_s": curve[-1]["wall_s"],
            "bytes_per_step": 1, "tx_bytes_per_step": None, "step_s": dt, "compute_s": dt / 2,
            "comm_wait_s": dt / 2, "params_equal": True}


def test_time_to_target_definitions():
    rows = [_row("dense", [0.5, 0.8, 0.9], dt=2.0), _row("topk", [0.6, 0.895, 0.9]),
            _row("gtopk", [0.89, 0.9, 0.91], dt=0.5), _row("rtopk", [0.5, 0.6, 0.7])]
    report.summarise(rows)
    d, t, g, r = rows
    assert d["target"] == pytest.approx(0.89) and d["time_to_target_s"] == 6.0
    assert t["time_to_target_s"] == 2.0 and g["time_to_target_s"] == 0.5
    assert g["speedup_vs_baseline"] == pytest.approx(12.0) and g["speedup_vs_topk"] == pytest.approx(4.0)
    assert r["time_to_target_s"] is None and r["speedup_vs_baseline"] is None
    assert "not reached" in report.markdown(rows)
    el = [_row("dense", [0.8, 0.9], "elastic", "barrier"), _row("gtopk", [0.896, 0.9], "elastic", "norm")]
    report.summarise(el)
    assert el[1]["target"] == pytest.approx(0.895) and el[1]["wall_reduction_vs_baseline"] == pytest.approx(0.5)


@pytest.mark.timeout(240)
def test_quick_run_writes_curves_and_loss_falls(tmp_path):
    out = tmp_path / "train.json"
    cmd = [sys.executable, "-m", "lab.train", "--quick", "--quiet", "--json", str(out)]
    if not netns.available()[0]:
        cmd.append("--no-netns")  # loopback, labelled unshaped
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=230)
    assert p.returncode == 0, p.stdout[-4000:]
    res = json.loads(out.read_text())
    assert res["meta"]["complete"] and (tmp_path / "train.md").exists()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "train.png").exists()
    rows = res["rows"]
    engines = {r["engine"] for r in rows}
    assert {"ddp", "elastic"} <= engines
    assert ("horovod" in engines) == harness.horovod_status()[0]
    for r in rows:
        assert len(r["curve"]) == 4 and len(r["step_times_s"]) == 20, r["name"]
        assert r["loss_last"] < r["loss_first"], (r["name"], r["losses"])
        assert r["params_equal"], r["name"]
        assert r["total_bytes"] > 0 and r["compute_s"] > 0
        # a thread's CPU time within a step cannot exceed the step's wall time
        assert 0 < r["step_cpu_s"] <= r["step_s"] + 1e-4, r["name"]
        # the job's CPU demand: every rank's process and the machine's ticks during the steps
        cpu = r["cpu"]
        assert cpu["workers_s_per_step"] > 0 and cpu["cores"] == os.cpu_count(), r["name"]
        assert 0 < cpu["machine_busy"] <= 1 and cpu["cpu_bound_step_s"] > 0, r["name"]
        if cpu_account.thread_schedstat() is not None:
            assert 0 <= cpu["runqueue_s"] <= r["step_s"], r["name"]
    dense = next(r for r in rows if r["engine"] == "ddp" and r["method"] == "dense")
    sparse = [r for r in rows if r["method"] == "gtopk"]
    assert all(r["bytes_per_step"] < dense["bytes_per_step"] / 10 for r in sparse)
    assert dense["target"] == pytest.approx(dense["final_accuracy"] - 0.01)
    # the same recipe through DDP and Horovod: the same training
    hv = [r for r in rows if r["engine"] == "horovod"]
    dd = next(r for r in rows if r["engine"] == "ddp" and r["method"] == "gtopk")
    for r in hv:
        assert r["losses"] == pytest.approx(dd["losses"], rel=1e-4)
    el = next(r for r in rows if r["engine"] == "elastic")
    assert el["latency_injected"][0]["waits"] > 0 and "transport" in res["meta"]["latency"]
