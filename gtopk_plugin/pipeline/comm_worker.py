"""The communication worker: one thread per reducer that runs its
reductions first in first out, beside the training thread, and hands each
back as a ``torch.futures.Future`` (docs/design.md §7 for the timeouts).

* Order: one job at a time in submission order, so ranks that submit the
  same jobs in the same order issue the same collectives in the same order.
* Futures complete with the job's result or its exception, never stay
  pending: :meth:`close` with ``cancel`` (and interpreter exit) fails the
  jobs not yet run with :class:`WorkerClosed`.
* Failure scope: after a job raised, the jobs behind it fail at once with
  :class:`EarlierFailure` (chained to the cause) without running, up to the
  next job submitted with ``fresh=True`` (the caller marks each step's
  first): the same jobs on every rank, and one transport timeout per fault.
* CUDA (``device`` a CUDA device): jobs run on a side stream that first
  waits for the submitting thread's current stream (an event recorded at
  submission), so selection kernels and NCCL transfers never block the
  default stream; the futures carry CUDA events (``Future(devices=...)``):
  whoever waits on one synchronises its own current stream with the job.
"""
from __future__ import annotations

import atexit
import queue
import threading
import weakref
from typing import Any, Optional

import torch

__all__ = ["CommWorker", "WorkerClosed", "EarlierFailure", "wait_for"]


class WorkerClosed(RuntimeError):
    """The worker was closed (or the interpreter is exiting) before the job ran."""


class EarlierFailure(RuntimeError):
    """A job submitted earlier in the same step failed, so this one did not
    run (its cause is that failure)."""


_STOP = object()
_LIVE: "weakref.WeakSet[_Core]" = weakref.WeakSet()


class _Core:
    """The queue and the thread; holds no reference to the :class:`CommWorker`
    (a dropped worker is collected, which stops the thread)."""

    def __init__(self, name: str, device: Optional[torch.device]):
        self.name, self.device = name, device
        self.q: "queue.SimpleQueue" = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.thread: Optional[threading.Thread] = None
        self.closed = False
        self.cancel = False          # fail what is still queued instead of running it
        self.failed: Optional[BaseException] = None  # worker thread only
        self.stream = None
        self.pending = 0  # jobs submitted and not finished (under lock)

    def put(self, item) -> None:
        with self.lock:
            if self.closed:
                raise WorkerClosed(f"gtopk_plugin: communication worker {self.name!r} is closed")
            if self.thread is None:
                if self.device is not None and self.device.type == "cuda":
                    self.stream = torch.cuda.Stream(device=self.device)
                self.thread = threading.Thread(target=_serve, args=(self,), name=self.name, daemon=True)
                self.thread.start()
                _LIVE.add(self)
            self.pending += 1
            self.q.put(item)

    def done_one(self) -> None:
        with self.lock:
            self.pending -= 1

    def close(self, cancel: bool = False, timeout: Optional[float] = None) -> bool:
        with self.lock:
            if cancel:
                self.cancel = True
            if not self.closed:
                self.closed = True
                if self.thread is not None:
                    self.q.put(_STOP)
            t = self.thread
        if t is None or t is threading.current_thread():
            return True
        t.join(timeout)
        return not t.is_alive()


def _serve(core: _Core) -> None:
    while True:
        item = core.q.get()
        if item is _STOP:
            return
        fut, fn, args, kwargs, fresh, event = item
        del item
        if core.cancel:
            fut.set_exception(WorkerClosed(f"gtopk_plugin: communication worker {core.name!r} was closed "
                                           "before this job ran"))
        else:
            if fresh:
                core.failed = None
            if core.failed is not None:
                err = EarlierFailure(f"gtopk_plugin: not run, an earlier job of this step failed: "
                                     f"{type(core.failed).__name__}: {core.failed}")
                err.__cause__ = core.failed
                fut.set_exception(err)
            else:
                _run(core, fut, fn, args, kwargs, event)
        core.done_one()
        del fut, fn, args, kwargs, event  # nothing of a finished job stays referenced here


def _run(core: _Core, fut, fn, args, kwargs, event) -> None:
    try:
        if core.stream is None:
            result = fn(*args, **kwargs)
        else:
            with torch.cuda.device(core.device), torch.cuda.stream(core.stream):
                core.stream.wait_event(event)
                _record_stream((args, kwargs), core.stream)
                result = fn(*args, **kwargs)
                fut.set_result(result)  # its events are recorded on the side stream
                return
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
        core.failed = e
        fut.set_exception(e)
        return
    fut.set_result(result)


def _record_stream(obj, stream, depth: int = 0) -> None:
    """Tell the caching allocator that ``stream`` uses the CUDA tensors in
    ``obj`` (tensors, and lists, tuples and dict values of them): memory the
    caller frees meanwhile is not handed out again before the side stream
    is done with it."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            obj.record_stream(stream)
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for o in obj:
            _record_stream(o, stream, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for o in obj.values():
            _record_stream(o, stream, depth + 1)


class CommWorker:
    """Runs submitted jobs one at a time, in order, on a thread of its own
    (started at the first :meth:`submit`).

    Args:
        name: the thread's name.
        device: where the jobs' tensors live; a CUDA device gives the jobs a
            side stream (module docstring).  ``None`` or CPU: a plain thread.
    """

    def __init__(self, name: str = "gtopk-comm", device=None):
        device = None if device is None else torch.device(device)
        self._core = _Core(name, device)
        # collected (or still alive at interpreter exit): stop the thread
        # without waiting for it -- a job stuck on a dead peer must block
        # neither the collecting thread nor the exit (timeout 0)
        self._finalizer = weakref.finalize(self, _Core.close, self._core, False, 0.0)

    @property
    def name(self) -> str:
        return self._core.name

    @property
    def device(self) -> Optional[torch.device]:
        return self._core.device

    @property
    def stream(self):
        """The side stream on CUDA (made at the first submit), else ``None``."""
        return self._core.stream

    def submit(self, fn, *args, fresh: bool = False, **kwargs) -> torch.futures.Future:
        """Queue ``fn(*args, **kwargs)``; its future completes with the return
        value or the exception.  ``fresh=True`` starts a new failure scope
        (module docstring): this job runs even if an earlier one failed."""
        core = self._core
        event, devices = None, None
        if core.device is not None and core.device.type == "cuda":
            devices = [core.device]
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(core.device))
        fut = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        core.put((fut, fn, args, kwargs, bool(fresh), event))
        return fut

    def on_worker_thread(self) -> bool:
        """Whether the caller is this worker's thread (a job calling back in)."""
        return self._core.thread is threading.current_thread()

    def drain(self, timeout: Optional[float] = None) -> None:
        """Wait until every job submitted so far has finished (run or failed);
        ``TimeoutError`` after ``timeout`` seconds.  The jobs' errors stay
        with their futures."""
        if self._core.pending == 0 or self.on_worker_thread():
            return
        wait_for(self.submit(_nothing), timeout, what=f"communication worker {self.name!r}",
                 raise_error=False)

    @property
    def idle(self) -> bool:
        """No job submitted and unfinished (as seen by the submitting thread)."""
        return self._core.pending == 0

    @property
    def closed(self) -> bool:
        return self._core.closed

    @property
    def alive(self) -> bool:
        t = self._core.thread
        return t is not None and t.is_alive()

    def close(self, cancel: bool = False, timeout: Optional[float] = None) -> bool:
        """Stop the thread after the jobs already submitted (``cancel=True``:
        they fail with :class:`WorkerClosed` instead of running) and wait up
        to ``timeout`` seconds for it; True when it has ended.  Later submits
        raise :class:`WorkerClosed`.  Idempotent."""
        return self._core.close(cancel, timeout)


def _nothing():
    return None


def wait_for(fut: torch.futures.Future, timeout: Optional[float], what: str = "a reduction",
             raise_error: bool = True) -> Any:
    """``fut``'s value, waiting at most ``timeout`` seconds (``None``: no
    limit) -- ``torch.futures.Future.wait`` takes no timeout.  Raises the
    job's exception, or ``TimeoutError`` naming ``what``."""
    if timeout is not None and not fut.done():
        done = threading.Event()
        fut.add_done_callback(lambda _: done.set())
        if not done.wait(timeout):
            raise TimeoutError(f"gtopk_plugin: {what} did not finish within {timeout:g} s (a peer died "
                               "or stopped training)")
    if not raise_error:
        try:
            return fut.wait()
        except BaseException:  # noqa: BLE001 - the caller asked only for completion
            return None
    return fut.wait()


@atexit.register
def _close_all() -> None:
    # Interpreter exit: the jobs not yet run fail (nobody will wait for them),
    # the one running gets a moment to end; the threads are daemons, so one
    # stuck on a dead peer never keeps the process alive.
    for core in list(_LIVE):
        core.close(cancel=True, timeout=1.0)
