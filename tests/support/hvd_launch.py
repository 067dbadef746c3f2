"""Launch real ``horovodrun --gloo`` jobs from tests (PyTorch and TensorFlow).

The horovodrun next to this interpreter runs ``python args...`` under
``-np np_``; the whole process group is killed on timeout, so no worker
outlives a test and nothing can hang CI.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the scripts horovodrun runs (tests/jobs/)
JOBS = os.path.join(ROOT, "tests", "jobs")


def require_horovod() -> None:
    """Skip the calling test module, loudly, when horovod.torch cannot be
    imported (conftest.py repeats the tag in the terminal summary)."""
    import pytest

    try:
        import horovod.torch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: no Horovod here
        pytest.skip(f"HOROVOD TESTS SKIPPED: horovod cannot be imported ({type(e).__name__}: {e}); "
                    "run `bash scripts/install_horovod.sh`", allow_module_level=True)


def horovodrun(np_: int, args: Sequence[str], timeout: int = 300, hosts: Optional[Sequence[str]] = None,
               gloo_timeout: int = 60):
    """Run ``horovodrun -np np_ --gloo python args...`` from the repository
    root; returns ``(returncode, combined output)``.  ``hosts``: launcher
    arguments replacing ``-H localhost:np_`` (elastic mode)."""
    bindir = os.path.dirname(sys.executable)
    exe = os.path.join(bindir, "horovodrun")
    if not os.path.exists(exe):
        exe = shutil.which("horovodrun")
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    hosts = ["-H", f"localhost:{np_}"] if hosts is None else list(hosts)
    cmd = [exe, "-np", str(np_)] + hosts + ["--gloo", "--gloo-timeout-seconds", str(gloo_timeout),
                                            sys.executable] + list(args)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"horovodrun -np {np_} {' '.join(args)} did not finish within {timeout} s:\n"
                             f"{out[-4000:]}")
    return proc.returncode, out


def elastic_hosts(tmp_path, np_: int):
    """Launcher arguments for an elastic job of exactly ``np_`` local workers:
    a host discovery script in ``tmp_path`` that always answers
    ``localhost:np_`` (``--network-interface lo``: elastic mode otherwise
    probes every interface)."""
    discover = os.path.join(str(tmp_path), "discover.sh")
    with open(discover, "w") as f:
        f.write(f"#!/bin/sh\necho localhost:{np_}\n")
    os.chmod(discover, 0o755)
    return ["--min-np", str(np_), "--max-np", str(np_), "--host-discovery-script", discover,
            "--network-interface", "lo"]


def job_results(np_: int, script: str, load, timeout: int = 300, gloo_timeout: int = 60) -> list:
    """Run ``tests/jobs/<script> OUTDIR`` under ``horovodrun -np np_`` and
    return every rank's ``load(OUTDIR/rank{r}.<ext>)`` (``load`` gets the
    directory and the rank); a failed job fails the test with its output."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gtopk-hvd-job-") as d:
        rc, out = horovodrun(np_, [os.path.join(JOBS, script), d], timeout=timeout, gloo_timeout=gloo_timeout)
        assert rc == 0, f"horovodrun -np {np_} {script} failed (rc {rc}):\n{out[-6000:]}"
        return [load(d, r) for r in range(np_)]


def ok(res: dict, key: str):
    """The value a job recorded under ``key`` as ``("ok", value)``; its
    recorded exception (type, message, traceback) fails the test."""
    status, val = res[key]
    if status != "ok":
        raise AssertionError(f"rank {res['rank']} {key!r} raised {val[0]}: {val[1]}\n{val[2]}")
    return val
