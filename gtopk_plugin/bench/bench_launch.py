"""Start P benchmark workers, one process per rank, and collect what each
returns: :func:`gtopk_plugin._launch.launcher.run` with what only
benchmarks need on top.

:func:`run_workers` runs ``target(ctx, payload)`` on every rank with the
output captured (progress lines become callbacks, every rank's last lines
go into the error), after setting up the engine: ``torch`` (a gloo group:
file store on loopback, or TCP at ``master_addr:master_port``), ``none``,
or any ``"module:Class"`` the launcher takes.  Results travel as JSON.  On
any failure, timeout or Ctrl-C every worker's process group is killed
before :class:`WorkerFailed` is raised.  Also here: :func:`horovodrun` and
:func:`merge_max` for per-rank timings.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence, Union

from gtopk_plugin._launch import launcher as _launch

#: The directory that holds this package's top-level package (the
#: repository root in a checkout): what a ``python -m`` child needs on its path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(
    importlib.import_module(__name__.split(".")[0]).__file__)))

WorkerFailed = _launch.LaunchError
free_port = _launch.free_port
die_with_parent = _launch.die_with_parent
stop_all = _launch.stop_all


def _as_json(ctx, target: str, payload):
    """The worker side: ``target(ctx, payload)``, its result as JSON would
    carry it (the results are what the benchmarks write)."""
    from gtopk_plugin._launch.launcher import resolve_target

    return json.loads(json.dumps(resolve_target(target)(ctx, payload)))


def run_workers(P: int, target: Union[str, Callable], payload, *, engine: str = "torch",
                master_addr: Optional[str] = None, master_port: Optional[int] = None,
                ifname: str = "lo", prefix: Optional[Callable[[int], List[str]]] = None,
                env: Optional[Callable[[int], Dict[str, str]]] = None, timeout: float = 1800.0,
                progress: Optional[Callable[[int, dict], None]] = None,
                echo: bool = False) -> list:
    """Run ``target(ctx, payload)`` (a module-level function, or
    ``"module:function"``) on P ranks; return the list of per-rank results
    (index = rank).

    Args:
        engine: "torch", "none" or a launcher engine as ``"module:Class"``
            (see the module docstring).
        master_addr, master_port: TCP rendezvous of the torch engine (rank 0
            hosts the store; default port: a free one); default: a file store.
        ifname: the interface gloo binds to (``GLOO_SOCKET_IFNAME``).
        prefix: rank -> command prefix, e.g. ``["ip", "netns", "exec", ns]``.
        env: rank -> extra environment variables.
        timeout: seconds for the whole job; past it every worker is killed.
        progress: called with (rank, message dict) for each ``ctx.progress``.
        echo: copy workers' output to stderr as it arrives.
    """
    if engine not in ("torch", "none") and ":" not in engine:
        raise ValueError(f"unknown engine {engine!r}; pass 'torch', 'none' or 'module:Class'")
    return _launch.run(P, _as_json, _launch.target_name(target), payload, engine=engine,
                       timeout=timeout, master_addr=master_addr, master_port=master_port, ifname=ifname,
                       prefix=prefix, env=env, output="capture", echo=echo, progress=progress)


def horovodrun(P: int, argv: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None) -> str:
    """``horovodrun -np P -H localhost:P --gloo python argv...`` from the
    repository root with the horovodrun next to this interpreter; returns the
    combined output; exits with its tail if the job fails."""
    bindir = os.path.dirname(sys.executable)
    exe = os.path.join(bindir, "horovodrun")
    if not os.path.exists(exe):
        exe = shutil.which("horovodrun") or "horovodrun"
    run_env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    run_env["PATH"] = bindir + os.pathsep + run_env.get("PATH", "")  # the child's environment
    cmd = [exe, "-np", str(P), "-H", f"localhost:{P}", "--gloo", sys.executable] + list(argv)
    proc = subprocess.run(cmd, cwd=ROOT, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"horovodrun -np {P} failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}")
    return proc.stdout


def merge_max(per_rank: Sequence[Sequence[dict]], keys: Sequence[str]) -> List[dict]:
    """Rank 0's rows with ``keys`` replaced by their maximum over ranks (the
    slowest worker sets the pace of a synchronous step).  List-valued keys
    are maximised element-wise (per step)."""
    out = []
    for i, row in enumerate(per_rank[0]):
        row = dict(row)
        for k in keys:
            vals = [rows[i][k] for rows in per_rank]
            if isinstance(vals[0], list):
                row[k] = [max(x) for x in zip(*vals)]
            else:
                row[k] = max(vals)
        out.append(row)
    return out
