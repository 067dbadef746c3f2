"""``gtopk-bench train``'s row from per-rank results: bytes are each rank's
own sums (the busiest rank's), so an elastic job -- whose ranks send a
step's late reductions during different later steps -- is not counted
twice.  Oracle: the sums written out by hand."""
from benchmarks.train import report


def _rank(times, sent, tx=None):
    n = len(times)
    return {"times": times, "bytes": sent, "tx": tx if tx is not None else [None] * n, "compute": [0.01],
            "cpu": [0.001] * n, "losses": [1.0] * n, "checksum": 1.0,
            "evals": [{"step": n, "eval": {"accuracy": 0.5, "loss": 1.0}}]}


def test_a_synchronous_job_sends_the_same_every_step():
    row = report.merge([_rank([0.1] * 4, [10] * 4), _rank([0.2] * 4, [10] * 4)], {}, "lo")
    assert row["total_bytes"] == 40 and row["bytes_per_step"] == 10
    assert row["curve"][-1]["bytes"] == 40 and row["wall_s"] == 0.8


def test_late_reductions_in_other_steps_are_not_counted_twice():
    # every rank sends 40 bytes over 4 steps, in different steps; the
    # per-step maximum over ranks would say 10 + 20 + 20 + 20 = 70
    ranks = [_rank([0.1] * 4, [10, 0, 20, 10], tx=[12, 0, 24, 12]),
             _rank([0.1] * 4, [0, 20, 0, 20], tx=[0, 24, 0, 24])]
    row = report.merge(ranks, {}, "lo")
    assert row["total_bytes"] == 40 and row["bytes_per_step"] == 10
    assert row["tx_bytes_per_step"] == 12


def test_the_per_step_figure_leaves_out_the_density_warm_up_and_the_busiest_rank_counts():
    ranks = [_rank([0.1] * 4, [50, 50, 10, 10]), _rank([0.1] * 4, [50, 50, 12, 12])]
    row = report.merge(ranks, {"warmup_steps": 2}, "lo")
    assert row["bytes_per_step"] == 12 and row["total_bytes"] == 124
    assert row["warmup_steps"] == 2


def test_engines_that_count_nothing_report_none():
    row = report.merge([_rank([0.1] * 3, [None] * 3)], {}, "lo")
    assert row["bytes_per_step"] is None and row["tx_bytes_per_step"] is None and row["total_bytes"] == 0
