"""``python -m lab cluster ddp --quick`` (lab/cluster/ddp.py): DDP with
PyTorch's own hooks and ours in one run, P = 2, a tiny MLP, 3 steps per row.

Runs in shaped network namespaces where they can be made and on loopback
otherwise (the result says which; nothing is skipped).  No timing asserts:
every row present, identical parameters on every rank after the steps, our
hooks' bytes per step equal to the reducer's accounting and to the
transport's own counters, PyTorch's equal to the ring model of what they
allreduce."""
import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from lab.cluster import cli, ddp, netns  # noqa: E402


def test_quick_run(tmp_path):
    out = str(tmp_path / "ddp.json")
    assert cli.main(["ddp", "--quick", "--quiet", "--json", out, "--timeout", "80"]) == 0
    res = json.load(open(out))
    s, rows = res["settings"], res["rows"]
    P = s["P"]
    assert P == 2 and s["warmup"] + s["rounds"] * s["per_round"] == 3
    # shaped where namespaces work, else loopback labelled "unshaped"
    ok, _ = netns.available()
    assert res["meta"]["network"]["shaped"] is ok
    assert {r["label"] for r in rows} == {"shaped" if ok else "unshaped"}
    assert [r["name"] for r in rows] == [name for name, _, _ in ddp.ROWS]
    numel = rows[0]["numel"]
    assert numel == sum(a * b + b for a, b in zip(ddp.QUICK_WIDTHS[:-1], ddp.QUICK_WIDTHS[1:]))
    ring = 2 * (P - 1) / P
    for r in rows:
        # the floor row averages nothing, so its ranks drift apart
        assert r["params_identical"] is (r["kind"] != "floor"), r["name"]
        assert len(r["times"]) == 1 and r["median_ms"] > 0, r["name"]
        assert len(r["params_sha256"]) == P
        if r["kind"] == "ours":
            # what the benchmark reports is the reducer's accounting
            # (SparseState.last_step_traffic) and the transport's counters
            assert r["bytes_per_rank_step"] == r["transport_bytes_per_rank_step"], r["name"]
            assert r["bytes_per_step"] == max(b[0] for b in r["bytes_per_rank_step"])
            assert 0 < r["bytes_per_step"] < ring * 4 * numel, r["name"]
        else:
            assert r["transport_bytes_per_rank_step"] == [[None]] * P
    assert rows[0]["kind"] == "floor" and rows[0]["bytes_per_step"] == 0
    for r in rows:  # the reducer's phase times: ours only
        assert (r["hook_phases_ms"] is not None) is (r["kind"] == "ours"), r["name"]
    by = {r["name"]: r for r in rows}
    assert by["allreduce (DDP default)"]["bytes_per_step"] == ring * 4 * numel
    assert by["fp16_compress_hook"]["bytes_per_step"] == ring * 2 * numel
    assert by["bf16_compress_hook"]["bytes_per_step"] == ring * 2 * numel
    assert by["powerSGD_hook rank 4"]["buckets_per_step"] == 1
    for r in rows:
        assert r["hook_calls_per_step"] in (None, r["buckets_per_step"]), r["name"]
        assert sum(r["ddp_bucket_sizes"]) == numel, r["name"]
    assert by["powerSGD_hook rank 4"]["bytes_per_step"] < ring * 4 * numel
    assert by["sparse_hook gtopk 0.1%"]["bytes_per_step"] <= by["sparse_hook gtopk 1%"]["bytes_per_step"]
    sm = res["summary"]
    assert sm["goal"] == ddp.GOAL and isinstance(sm["goal_met"], bool)
    assert isinstance(sm["goal_reachable_here"], bool)
    assert res["meta"]["loadavg_start"] and res["meta"]["loadavg_end"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert os.path.exists(str(tmp_path / "ddp.png"))
    assert not [n for n in netns.list_namespaces() if n.startswith(f"{netns.PREFIX}-{os.getpid()}-")]
