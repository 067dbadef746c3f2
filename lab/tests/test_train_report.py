"""``python -m lab train``'s row from per-rank results: bytes are each rank's
own sums (the busiest rank's), so an elastic job -- whose ranks send a
step's late reductions during different later steps -- is not counted
twice.  Oracle: the sums written out by hand."""
from lab.train import report


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


# -- CPU demand (the machine's cores are shared by every worker) ----------------

def test_cpu_demand_sums_every_ranks_process_cpu_and_reads_the_machines_ticks():
    a, b = _rank([0.1] * 4, [0] * 4), _rank([0.1] * 4, [0] * 4)
    a["proc_cpu"], b["proc_cpu"] = [0.05, 0.07, 0.06, 0.06], [0.10, 0.02, 0.04, 0.04]
    # 2 cores at 100 ticks/s over 0.4 s of steps: 80 ticks, 60 of them busy (10 softirq)
    a.update(machine_ticks={"user": 40, "nice": 0, "system": 8, "idle": 16, "iowait": 4, "irq": 2,
                            "softirq": 10, "steal": 0}, ticks_per_s=100, cores=2)
    cpu = report.merge([a, b], {}, "lo")["cpu"]
    assert abs(cpu["workers_s_per_step"] - (0.24 + 0.20) / 4) < 1e-12
    assert abs(cpu["machine_busy"] - 60 / 80) < 1e-12 and abs(cpu["machine_softirq"] - 10 / 80) < 1e-12
    assert abs(cpu["machine_s_per_step"] - 0.60 / 4) < 1e-12      # 60 busy ticks = 0.6 CPU-s over 4 steps
    assert abs(cpu["cpu_bound_step_s"] - 0.60 / 4 / 2) < 1e-12    # spread over both cores


def test_rows_recorded_before_the_cpu_counters_show_dashes():
    row = report.merge([_rank([0.1] * 2, [1, 1])], {}, "lo")
    assert row["cpu"] is None
    row.update(workload="vgg", rate_label="1gbit", seed=0, engine="ddp", name="dense")
    line = report.markdown([row]).splitlines()
    cells = [len(x.strip().strip("|").split("|")) for x in line]
    assert cells[0] == cells[1] == cells[2]                      # header, rule and row agree
    assert line[2].rstrip(" |").endswith("| – | – | – | – | yes")


def test_the_training_threads_wait_for_a_core_is_the_median_of_each_steps_largest():
    a, b = _rank([0.1] * 3, [0] * 3), _rank([0.1] * 3, [0] * 3)
    a["proc_cpu"] = b["proc_cpu"] = [0.01] * 3
    a["runq"], b["runq"] = [0.010, 0.030, 0.002], [0.020, 0.001, 0.050]
    assert abs(report.merge([a, b], {}, "lo")["cpu"]["runqueue_s"] - 0.030) < 1e-12   # median of 20, 30, 50 ms
    b["runq"] = [None] * 3                                                           # no schedstat here
    assert "runqueue_s" not in report.merge([a, b], {}, "lo")["cpu"]
