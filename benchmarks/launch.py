"""Start P benchmark workers, one process per rank, and collect what each returns.

Shared by the benchmarks that run real process groups
(``benchmarks/bytes_per_step.py`` on loopback, ``benchmarks/cluster`` in
network namespaces).  The parent side is :func:`run_workers`; each worker is
``python -m benchmarks.launch SPEC RANK OUTDIR``, which

1. sets up the engine named in the spec (``torch``: a torch.distributed gloo
   group over ``MASTER_ADDR``/``MASTER_PORT`` on ``GLOO_SOCKET_IFNAME``;
   ``horovod``: ``hvd.init()`` with Horovod's gloo controller, whose
   rendezvous the caller started; ``none``: nothing),
2. calls the target ``module:function`` as ``fn(ctx, payload)``
   (:class:`WorkerContext` gives rank, size, a barrier, a transport and a
   progress reporter),
3. writes the returned JSON-able value to ``OUTDIR/rank{R}.json``.

The parent starts every rank with an optional command prefix (such as
``ip netns exec NS``), streams their output, turns ``@@progress`` lines into
callbacks, and on any failure, timeout or Ctrl-C kills every worker's
process group before raising, so no worker outlives the call.
"""
from __future__ import annotations

import collections
import ctypes
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROGRESS = "@@progress "


class WorkerFailed(RuntimeError):
    """A worker exited non-zero, or the job timed out; carries every rank's
    last lines of output."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (loopback runs)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent():  # pragma: no cover - runs in the child before exec
    # PR_SET_PDEATHSIG survives exec of non-setuid programs (``ip netns exec``
    # execs python in turn): a worker never outlives a SIGKILLed parent.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def _kill_group(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_all(procs: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM every worker's process group, then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            _kill_group(p)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(p, signal.SIGKILL)
            p.wait()


def run_workers(P: int, target: str, payload, *, engine: str = "torch",
                master_addr: str = "127.0.0.1", master_port: Optional[int] = None,
                ifname: str = "lo", prefix: Optional[Callable[[int], List[str]]] = None,
                env: Optional[Callable[[int], Dict[str, str]]] = None, timeout: float = 1800.0,
                progress: Optional[Callable[[int, dict], None]] = None,
                echo: bool = False) -> list:
    """Run ``target`` (``"module:function"``) on P ranks; return the list of
    per-rank results (index = rank).

    Args:
        engine: "torch", "horovod" or "none" (see the module docstring).
        master_addr, master_port: torch.distributed rendezvous (rank 0 hosts
            the store); default port: a free loopback port.
        ifname: the interface gloo binds to (``GLOO_SOCKET_IFNAME``).
        prefix: rank -> command prefix, e.g. ``["ip", "netns", "exec", ns]``.
        env: rank -> extra environment variables.
        timeout: seconds for the whole job; past it every worker is killed.
        progress: called with (rank, message dict) for each ``ctx.progress``.
        echo: copy workers' output to stderr as it arrives.
    """
    if master_port is None:
        master_port = free_port(master_addr if master_addr.startswith("127.") else "127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="gtopk-launch-") as tmp:
        spec = os.path.join(tmp, "spec.json")
        with open(spec, "w") as f:
            json.dump({"target": target, "payload": payload, "engine": engine, "world": P,
                       "timeout": timeout}, f)
        procs: List[subprocess.Popen] = []
        tails = [collections.deque(maxlen=60) for _ in range(P)]
        sel = selectors.DefaultSelector()
        try:
            for r in range(P):
                e = dict(os.environ)
                e.update(PYTHONPATH=os.pathsep.join(filter(None, [ROOT, e.get("PYTHONPATH")])),
                         MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                         GLOO_SOCKET_IFNAME=ifname, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                         RANK=str(r), WORLD_SIZE=str(P))
                if env is not None:
                    e.update(env(r))
                cmd = list(prefix(r) if prefix else []) + [sys.executable, "-m", "benchmarks.launch",
                                                           spec, str(r), tmp]
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=e,
                                     cwd=ROOT, start_new_session=True, preexec_fn=_die_with_parent)
                procs.append(p)
                os.set_blocking(p.stdout.fileno(), False)
                sel.register(p.stdout, selectors.EVENT_READ, r)
            bufs = [b""] * P
            deadline = time.monotonic() + timeout
            open_streams = P
            while open_streams:
                if time.monotonic() > deadline:
                    raise WorkerFailed(_report(f"timed out after {timeout:g} s", procs, tails))
                for key, _ in sel.select(timeout=1.0):
                    r = key.data
                    chunk = key.fileobj.read()
                    if not chunk:
                        sel.unregister(key.fileobj)
                        open_streams -= 1
                        continue
                    bufs[r] += chunk
                    *lines, bufs[r] = bufs[r].split(b"\n")
                    for raw in lines:
                        line = raw.decode(errors="replace")
                        if line.startswith(_PROGRESS):
                            if progress is not None:
                                progress(r, json.loads(line[len(_PROGRESS):]))
                            continue
                        tails[r].append(line)
                        if echo:
                            print(f"[rank {r}] {line}", file=sys.stderr, flush=True)
                # one failed rank: the others would block in a collective until
                # their timeout; stop everyone now and report.
                if any(p.poll() not in (None, 0) for p in procs):
                    time.sleep(0.5)  # let the failing rank's last words arrive
                    _drain(sel, tails)
                    raise WorkerFailed(_report("a worker failed", procs, tails))
            for p in procs:
                p.wait(max(1.0, deadline - time.monotonic()))
            if any(p.returncode != 0 for p in procs):
                raise WorkerFailed(_report("a worker failed", procs, tails))
            results = []
            for r in range(P):
                with open(os.path.join(tmp, f"rank{r}.json")) as f:
                    results.append(json.load(f))
            return results
        finally:
            _stop_all(procs)
            sel.close()
            for p in procs:
                p.stdout.close()


def _drain(sel, tails):
    for key, _ in sel.select(timeout=0.1):
        chunk = key.fileobj.read() or b""
        for raw in chunk.split(b"\n"):
            if raw and not raw.startswith(_PROGRESS.encode()):
                tails[key.data].append(raw.decode(errors="replace"))


def _report(what, procs, tails) -> str:
    codes = [p.poll() for p in procs]
    parts = [f"{what}; exit codes by rank: {codes}"]
    for r, t in enumerate(tails):
        if t:
            parts.append(f"--- rank {r} (last lines) ---\n" + "\n".join(list(t)[-25:]))
    return "\n".join(parts)


def horovodrun(P: int, argv: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None) -> str:
    """``horovodrun -np P -H localhost:P --gloo python argv...`` from the
    repository root with the horovodrun next to this interpreter; returns the
    combined output; exits with its tail if the job fails."""
    bindir = os.path.dirname(sys.executable)
    exe = os.path.join(bindir, "horovodrun")
    if not os.path.exists(exe):
        exe = shutil.which("horovodrun") or "horovodrun"
    run_env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), OMP_NUM_THREADS="1",
                   TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
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


# --------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------
class WorkerContext:
    """What a target function gets: ``rank``, ``size``, ``engine``,
    ``barrier()``, ``transport`` (a gtopk_plugin Transport on the engine) and
    ``progress(**fields)`` (forwarded to the parent from rank 0)."""

    def __init__(self, rank: int, size: int, engine: str, timeout: float):
        self.rank, self.size, self.engine, self.timeout = rank, size, engine, timeout
        self._transport = None
        self._hvd = None

    def init(self):
        import datetime

        import torch
        torch.set_num_threads(1)
        if self.engine == "torch":
            import torch.distributed as dist
            dist.init_process_group("gloo", rank=self.rank, world_size=self.size,
                                    timeout=datetime.timedelta(seconds=self.timeout))
        elif self.engine == "horovod":
            import horovod.torch as hvd
            hvd.init()
            if hvd.rank() != self.rank or hvd.size() != self.size:
                raise RuntimeError(f"Horovod says rank {hvd.rank()}/{hvd.size()}, the launcher "
                                   f"started rank {self.rank}/{self.size}")
            self._hvd = hvd
        elif self.engine != "none":
            raise ValueError(f"unknown engine {self.engine!r}")

    @property
    def transport(self):
        if self._transport is None:
            if self.engine == "torch":
                from gtopk_plugin.frameworks.torch_distributed import TorchDistributedTransport
                self._transport = TorchDistributedTransport(timeout=self.timeout)
            elif self.engine == "horovod":
                from gtopk_plugin.frameworks.horovod import HorovodTransport
                self._transport = HorovodTransport()
            else:
                raise RuntimeError("engine 'none' has no transport")
        return self._transport

    def barrier(self):
        if self.engine == "torch":
            import torch.distributed as dist
            dist.barrier()
        elif self.engine == "horovod":
            self._hvd.barrier()

    def progress(self, **fields):
        if self.rank == 0:
            print(_PROGRESS + json.dumps(fields), flush=True)

    def shutdown(self):
        if self.engine == "torch":
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        elif self.engine == "horovod" and self._hvd is not None:
            self._hvd.shutdown()


def _worker_main(argv):
    spec_path, rank, outdir = argv[0], int(argv[1]), argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    ctx = WorkerContext(rank, int(spec["world"]), spec["engine"], float(spec["timeout"]))
    ctx.init()
    mod_name, fn_name = spec["target"].split(":")
    fn = getattr(importlib.import_module(mod_name), fn_name)
    result = fn(ctx, spec["payload"])
    tmp = os.path.join(outdir, f"rank{rank}.json.part")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(outdir, f"rank{rank}.json"))
    ctx.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
