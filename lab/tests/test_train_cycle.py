"""``python -m lab train --horovod-cycle-ms``: each Horovod method runs once per
cycle value, and each job's workers see that ``HOROVOD_CYCLE_TIME``.
Oracles: the grid written out by hand, and a child process's environment."""
import os
import subprocess
import sys

import pytest

from lab.cluster import harness
from lab.train import cli


def _args(**kw):
    args = cli.build_parser().parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_every_horovod_method_runs_once_per_cycle_value_and_ddp_once():
    cfgs = cli.configs(_args(engines="ddp,horovod", methods="gtopk,dense", horovod_cycle_ms="default,10"))
    got = [(c["engine"], c["method"], c["cycle_ms"]) for c in cfgs]
    assert got == [("ddp", "dense", None), ("ddp", "gtopk", None),
                   ("horovod", "dense", "default"), ("horovod", "dense", 10.0),
                   ("horovod", "gtopk", "default"), ("horovod", "gtopk", 10.0)]
    names = [c["name"] for c in cfgs if c["engine"] == "horovod"]
    assert len(set(names)) == 4 and names[1].endswith("cycle 10 ms") and names[0].endswith("(default)")


def test_without_the_option_horovod_jobs_keep_the_environments_cycle(monkeypatch):
    cfgs = cli.configs(_args(engines="horovod", methods="dense,topk"))
    assert [c["cycle_ms"] for c in cfgs] == [None, None]
    assert "cycle" not in cfgs[0]["name"]
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "7")
    with harness.horovod_cycle_env(None):
        assert _child_sees() == "7"


@pytest.mark.parametrize("spec", ["0", "-5", "fast", "10,x"])
def test_a_bad_cycle_value_is_a_clear_error(spec):
    with pytest.raises(SystemExit, match="--horovod-cycle-ms"):
        cli.horovod_cycles(spec)


def _child_sees():
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('HOROVOD_CYCLE_TIME'))"],
                         capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.strip()


def test_the_workers_of_a_job_inherit_the_cycle_and_it_is_restored_after(monkeypatch):
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "3")
    with harness.horovod_cycle_env(12.5):
        assert _child_sees() == "12.5"
    assert os.environ["HOROVOD_CYCLE_TIME"] == "3"
    with pytest.raises(RuntimeError):
        with harness.horovod_cycle_env("default"):
            assert _child_sees() == "None"  # unset: Horovod's own default
            raise RuntimeError("a failed job")
    assert os.environ["HOROVOD_CYCLE_TIME"] == "3"
