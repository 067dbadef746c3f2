"""The one process launcher: P worker processes on this machine joined in a
gloo group, supervised, their results collected.

    results = run(4, train, cfg, timeout=600)   # train(ctx, cfg) on ranks 0..3

Every program that runs real ranks goes through :func:`run` (``gtopk-demo``,
the benchmarks via ``gtopk_plugin/bench/bench_launch.py``, the distributed
tests).  One fresh interpreter per rank (``subprocess``, not ``fork``),
optionally behind a command prefix; the target travels pickled and the
child gets the parent's ``sys.path``.  Engine ``"torch"``: a gloo group
over a file store in a fresh temporary directory, or TCP at
``master_addr:master_port``; ``"none"``: nothing; ``"module:Class"``: an
engine class with ``init(ctx)``, ``barrier()``, ``transport()`` and
``shutdown()`` (so this package imports no framework, docs/design.md §1).
A rank that raises or dies ends the job by default (``fail_fast``), every
rank killed and the error naming the rank and its traceback; ``timeout``
bounds the whole job, and no worker outlives the call (own session,
killed on every exit path, ``PR_SET_PDEATHSIG``).  ``env=`` only sets
variables for the children; the library reads its settings in config.py.
"""
from __future__ import annotations

import collections
import ctypes
import json
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from gtopk_plugin._launch.launch_worker import (_BOOTSTRAP, _PACKAGE_PARENT, PROGRESS_TAG, WorkerContext,  # noqa: F401
                            resolve_target, target_name)

_TAIL_LINES = 60


class LaunchError(RuntimeError):
    """A worker failed or died, or the job timed out; every worker was killed."""


class WorkerError(LaunchError):
    """Rank ``rank`` raised ``exc_type`` (a type name) with ``message``."""

    def __init__(self, text: str, rank: int, exc_type: str, message: str, tb: str = ""):
        super().__init__(text)
        self.rank, self.exc_type, self.message, self.traceback = rank, exc_type, message, tb


class LaunchTimeout(LaunchError, TimeoutError):
    """The job ran past ``timeout`` seconds."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """``preexec_fn``: SIGKILL this process when its parent dies.
    ``PR_SET_PDEATHSIG`` survives exec of non-setuid programs (``ip netns
    exec`` execs python in turn), so a worker never outlives a SIGKILLed
    launcher."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def stop_all(procs: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM every process's group, then SIGKILL what is left after ``grace`` s."""
    def kill(p, sig):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    for p in procs:
        if p.poll() is None:
            kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill(p, signal.SIGKILL)
            p.wait()


# --------------------------------------------------------------------------
# the launcher (the worker side is launch_worker.py)
# --------------------------------------------------------------------------
def run(P: int, target: Union[str, Callable], *args: Any, engine: str = "torch",
        timeout: float = 600.0, pg_timeout: Optional[float] = None,
        master_addr: Optional[str] = None, master_port: Optional[int] = None, ifname: str = "lo",
        prefix: Optional[Callable[[int], List[str]]] = None,
        env: Optional[Callable[[int], Dict[str, str]]] = None, output: str = "inherit",
        echo: bool = False, progress: Optional[Callable[[int, dict], None]] = None,
        fail_fast: bool = True, raise_errors: bool = True) -> list:
    """Run ``target(ctx, *args)`` on ranks 0..P-1; the per-rank results.

    Args:
        target: a module-level function (or ``"module:function"``); ``ctx`` is
            a :class:`WorkerContext` (rank, size, barrier, transport, progress).
        engine: ``"torch"``, ``"none"`` or ``"module:Class"`` (module docstring).
        timeout: seconds for the whole job; past it every worker is killed
            and :class:`LaunchTimeout` raised.
        pg_timeout: the process group's collective timeout (default: ``timeout``).
        master_addr, master_port: TCP rendezvous (default: a file store).
        ifname: the interface gloo binds to (``GLOO_SOCKET_IFNAME``).
        prefix: rank -> command prefix, e.g. ``["ip", "netns", "exec", ns]``.
        env: rank -> environment variables set in that worker.
        output: ``"inherit"`` or ``"capture"`` (piped, kept for the error
            report, ``ctx.progress`` forwarded to ``progress``, echoed with ``echo``).
        fail_fast: stop every worker as soon as one fails (else wait for all).
        raise_errors: raise :class:`WorkerError` for a failed rank, else return
            per rank ``("ok", value)`` or ``("error", (type, message,
            traceback))`` (a silent death: ``("Died", "exit code N", "")``).
    """
    if P < 1:
        raise ValueError(f"P must be >= 1; got {P}")
    if output not in ("inherit", "capture"):
        raise ValueError(f"output must be 'inherit' or 'capture'; got {output!r}")
    capture = output == "capture"
    with tempfile.TemporaryDirectory(prefix="gtopk-launch-") as tmp:
        spec = {"target": target_name(target), "args": args, "engine": engine, "world": P,
                "pg_timeout": float(timeout if pg_timeout is None else pg_timeout),
                "rendezvous": (f"tcp://{master_addr}:{master_port or free_port()}" if master_addr
                               else f"file://{os.path.join(tmp, 'rendezvous')}"),
                "progress": bool(capture and progress), "outdir": tmp}
        spec_path = os.path.join(tmp, "spec.pkl")
        with open(spec_path, "wb") as f:
            pickle.dump([p or os.getcwd() for p in sys.path], f)
            pickle.dump(spec, f)
        procs: List[subprocess.Popen] = []
        watch = _Output(P, capture, echo, progress)
        try:
            for r in range(P):
                child_env = {"GLOO_SOCKET_IFNAME": ifname, "OMP_NUM_THREADS": "1",
                             "RANK": str(r), "WORLD_SIZE": str(P)}
                child_env.update(env(r) if env is not None else {})
                cmd = list(prefix(r) if prefix else []) + [
                    sys.executable, "-u", "-c", _BOOTSTRAP, json.dumps(child_env), _PACKAGE_PARENT,
                    spec_path, str(r)]
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE if capture else None,
                                     stderr=subprocess.STDOUT if capture else None,
                                     start_new_session=True, preexec_fn=die_with_parent)
                procs.append(p)
                watch.add(r, p)
            first = _supervise(procs, watch, timeout, fail_fast)
            results = [_result(tmp, r, procs[r]) for r in range(P)]
            when = [_written_at(tmp, r) for r in range(P)]
        finally:
            stop_all(procs)
            watch.close()
    if not raise_errors:
        return results
    bad = [r for r, (status, _) in enumerate(results) if status != "ok"]
    if bad:
        raise _worker_error(bad, first, when, results, watch)
    return [v for _, v in results]


def _supervise(procs, watch, timeout: float, fail_fast: bool) -> List[int]:
    """Wait for every worker; with ``fail_fast`` return at the first failure
    (the caller kills the rest); raise :class:`LaunchTimeout` at the
    deadline.  Returns the ranks seen failing first (their error is the
    cause; the others' usually follows from it)."""
    deadline = time.monotonic() + timeout
    first: List[int] = []
    while True:
        codes = [p.poll() for p in procs]
        if not first:
            first = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if fail_fast and first:
            watch.drain(0.5)  # the failing rank's last words
            return first
        if all(c is not None for c in codes):
            watch.drain(0.0)
            return first
        if time.monotonic() > deadline:
            hung = [r for r, c in enumerate(codes) if c is None]
            watch.drain(0.0)
            raise LaunchTimeout(f"timed out after {timeout:g} s (ranks {hung} of {len(procs)} still "
                                f"running); all workers were killed" + watch.report())
        watch.wait(min(0.2, max(0.0, deadline - time.monotonic())))


def _result(tmp: str, rank: int, proc: subprocess.Popen):
    path = os.path.join(tmp, f"result.{rank}")
    if proc.poll() is not None and os.path.exists(path):
        with open(path, "rb") as f:
            return pickle.load(f)
    if proc.poll() is None:
        return ("error", ("Killed", "stopped after another rank failed", ""))
    return ("error", ("Died", f"exit code {proc.returncode}", ""))


def _written_at(tmp: str, rank: int) -> float:
    try:
        return os.stat(os.path.join(tmp, f"result.{rank}")).st_mtime_ns
    except OSError:
        return float("inf")


def _worker_error(bad: List[int], first: List[int], when: List[float], results, watch) -> WorkerError:
    lines = []
    # The cause first: among the ranks that exited first, the one that wrote
    # its error first (its peers' errors -- "connection closed by peer" --
    # usually follow from it); then those that raised; then the dead.
    bad = sorted(bad, key=lambda r: (r not in first, results[r][1][0] in ("Died", "Killed"), when[r], r))
    for r in bad:
        exc, msg, tb = results[r][1]
        if exc == "Killed":
            continue
        if exc == "Died":
            lines.append(f"worker rank {r} died with {msg}")
        else:
            last = msg.splitlines()[-1] if msg else exc
            lines.append(f"worker rank {r} failed: {exc}: {last}\n{tb.rstrip()}")
    first = bad[0]
    exc, msg, tb = results[first][1]
    text = "\n".join(lines) + "\nall workers were killed" + watch.report()
    return WorkerError(text, first, exc, msg, tb)


class _Output:
    """The workers' piped output (``output="capture"``): per-rank tails for
    the error report, progress lines forwarded, optional echo."""

    def __init__(self, P: int, capture: bool, echo: bool, progress):
        self.capture, self.echo, self.progress = capture, echo, progress
        self.tails = [collections.deque(maxlen=_TAIL_LINES) for _ in range(P)]
        self.bufs = [b""] * P
        self.sel = selectors.DefaultSelector() if capture else None

    def add(self, rank: int, proc: subprocess.Popen) -> None:
        if self.capture:
            os.set_blocking(proc.stdout.fileno(), False)
            self.sel.register(proc.stdout, selectors.EVENT_READ, rank)

    def wait(self, seconds: float) -> None:
        if not self.capture or not self.sel.get_map():
            time.sleep(seconds)
            return
        for key, _ in self.sel.select(timeout=seconds):
            self._read(key)

    def drain(self, seconds: float) -> None:
        """Read what the workers wrote until they close their output (at most ``seconds``)."""
        if not self.capture:
            return
        end = time.monotonic() + seconds
        while self.sel.get_map():
            events = self.sel.select(timeout=max(0.0, end - time.monotonic()))
            if not events:
                break
            for key, _ in events:
                self._read(key)

    def _read(self, key) -> None:
        r = key.data
        chunk = key.fileobj.read()
        if not chunk:
            self.sel.unregister(key.fileobj)
            if self.bufs[r]:
                self._line(r, self.bufs[r].decode(errors="replace"))
                self.bufs[r] = b""
            return
        self.bufs[r] += chunk
        *lines, self.bufs[r] = self.bufs[r].split(b"\n")
        for raw in lines:
            self._line(r, raw.decode(errors="replace"))

    def _line(self, r: int, line: str) -> None:
        if line.startswith(PROGRESS_TAG):
            if self.progress is not None:
                self.progress(r, json.loads(line[len(PROGRESS_TAG):]))
            return
        self.tails[r].append(line)
        if self.echo:
            print(f"[rank {r}] {line}", file=sys.stderr, flush=True)

    def report(self) -> str:
        parts = [f"\n--- rank {r} (last lines) ---\n" + "\n".join(list(t)[-25:])
                 for r, t in enumerate(self.tails) if t]
        return "".join(parts)

    def close(self) -> None:
        if self.sel is not None:
            for key in list(self.sel.get_map().values()):
                key.fileobj.close()
            self.sel.close()
