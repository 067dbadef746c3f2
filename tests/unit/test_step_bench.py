"""``gtopk-bench step`` (gtopk_plugin/bench/step_bench.py) at a tiny size: every method's
row is written, and the "merge alone" entry feeds ``merge_select`` inputs a
butterfly round could hold (checked with numpy, independently of the
benchmark's construction).  No timing is asserted."""
import json
import os

import numpy as np
import pytest

from gtopk_plugin.bench import step_bench as step
from gtopk_plugin import kernels


def test_step_rows_and_merge_inputs(monkeypatch):
    seen = []
    real = kernels.merge_select

    def checked(idx_a, val_a, idx_b, val_b, offsets, k, **kw):
        off = offsets.numpy()
        for idx, val in ((idx_a, val_a), (idx_b, val_b)):
            i = idx.numpy().astype(np.int64)
            assert i.shape == val.shape and idx.dtype == idx_a.dtype
            for s in range(len(off) - 1):
                seg = i[(i >= off[s]) & (i < off[s + 1])]
                assert len(seg) == int(k[s])  # k entries in every segment
            assert np.all(np.diff(i) > 0)  # sorted, distinct (segments in order)
        # the partner's values are this rank's, permuted
        assert np.array_equal(np.sort(val_a.numpy()), np.sort(val_b.numpy()))
        seen.append(int(k.sum()))
        return real(idx_a, val_a, idx_b, val_b, offsets, k, **kw)

    monkeypatch.setattr(kernels, "merge_select", checked)
    lay = step.layouts([40_000])[0]
    payload = {"layouts": [lay], "threads": [1], "reps": 1, "seed": 3}
    rows = step.worker(None, payload)
    assert [r["method"] for r in rows] == [m[0] for m in step.METHODS]
    assert seen, "the merge entry never ran"
    for r in rows:
        assert set(step.PHASES) <= set(r["phases_ms"])
        assert r["workers"] == 1 and r["numel"] == 40_000
        if r["method"].startswith("gtopk"):
            assert r["merge_ms"] is not None and r["merge_ms"] > 0
        else:
            assert r["merge_ms"] is None
        # P = 1: nothing waits on a transport, so local compute is the total
        assert r["phases_ms"]["wait"] == 0
        assert r["local_ms"] == pytest.approx(r["phases_ms"]["total"], rel=1e-9)


def test_paired_ratio_is_the_median_of_per_repetition_ratios():
    lay = step.layouts([40_000])[0]
    rows = step.worker(None, {"layouts": [lay], "threads": [1], "reps": 5, "seed": 4})
    for r in rows:
        floor, local = np.array(r["floor_reps_ms"]), np.array(r["local_reps_ms"])
        assert len(floor) == len(local) == 5
        assert r["floor_ms"] == pytest.approx(np.median(floor), rel=1e-9)
        assert r["local_ms"] == pytest.approx(np.median(local), rel=1e-9)
        assert r["local_over_floor_paired"] == pytest.approx(np.median(local / floor), rel=1e-9)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_pin_pins_the_rank_and_restores_the_launcher(tmp_path):
    before = os.sched_getaffinity(0)
    out = tmp_path / "step.json"
    assert step.main(["--sizes", "40000", "--threads", "1", "--workers", "1", "--no-resnet",
                      "--reps", "1", "--pin", "--json", str(out)]) == 0
    # the P = 2 workers started after P = 1 inherit the launcher's affinity
    assert os.sched_getaffinity(0) == before
    rows = json.loads(out.read_text())["results"]
    assert rows and all(r["pinned_cpu"] == min(before) for r in rows)
