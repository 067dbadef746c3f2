"""The convergence study's hierarchical rows
(lab/convergence/hier.py): the simulation -- the flat method over the
node sums (``Oracle``, op="sum", divided by P) -- is the real
``HierarchicalReducer`` on gloo bit for bit (P = 4 as 2 x 2: a node sum of
two workers is one commutative IEEE addition, so the summation order cannot
matter), the training loop is ``sim.run``'s, and ``--quick`` writes its
files with a falling loss.  Accuracy is reported by the full run
(docs/hierarchical.md, "Convergence"), not asserted here."""
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from lab.convergence import hier, hier_report, momentum, sim, study  # noqa: E402


@pytest.mark.timeout(300)
def test_simulation_is_the_real_hierarchical_reducer():
    """Recipe gTop-k on digits, P = 4 in 2 nodes, 8 steps on gloo: final
    weights bit-identical, the leaders' inter-node bytes = log2(2)·8k."""
    spec = momentum.spec("digits", "gtopk", 4, hier.DENSITY, 0, "recipe", 8)
    (c,) = hier.gloo_check([(spec, 2)])
    assert c["params_bitwise_equal"], c
    assert c["bytes_formula_max_abs_diff"] == 0.0, c


def test_one_worker_per_node_is_the_flat_run():
    """nodes = P (L = 1): hier.run's loop with the op="sum" oracle / P is
    sim.run's flat run bit for bit (the two loops are the same loop)."""
    spec = momentum.spec("digits", "gtopk", 4, hier.DENSITY, 0, "recipe", 5)
    task = study._task("digits")
    a = hier.run(task, spec, nodes=4, keep_params=True)
    b = sim.run(task, spec, keep_params=True)
    assert torch.equal(a["params"], b["params"])
    assert a["bytes_per_step_curve"] == b["bytes_per_step_curve"]


def test_node_sums_in_rank_order():
    g = [{"w": torch.full((2,), float(r))} for r in range(6)]
    s = hier.node_sums(g, 3)
    assert [float(x["w"][0]) for x in s] == [1.0, 5.0, 9.0]


@pytest.mark.timeout(600)
def test_quick_run_writes_files_and_trains(tmp_path):
    out = tmp_path / "q.json"
    assert hier_report.main(["--quick", "--json", str(out)]) == 0
    res = json.load(open(out))
    for name in ("q.md", "q.png"):
        assert os.path.getsize(tmp_path / name) > 0
    assert len(res["runs"]) == 3
    for r in res["runs"]:
        assert not r["diverged"]
        assert r["final_eval_loss"] < r["initial_eval_loss"], r["spec"]
    (row,) = res["summary"]
    # gTop-k: log2(2)·8k per node vs log2(4)·8k per flat worker
    # (the JSON keeps 6 significant digits)
    assert row["hier_inter_bytes_per_node_step"] * 2 == pytest.approx(row["flat_bytes_per_worker_step"], rel=1e-5)
    assert "Hierarchical vs flat" in open(tmp_path / "q.md").read()
