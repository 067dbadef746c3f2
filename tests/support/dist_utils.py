"""Spawn real torch.distributed gloo process groups for tests.

Rendezvous goes through a file store in a fresh temporary directory (no fixed
port numbers; gloo's own sockets use ephemeral ports).  Every worker's return
value or exception comes back to the parent; a worker that does not finish
within ``timeout`` seconds fails the test and all workers are killed.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import tempfile
import traceback

_CTX = mp.get_context("spawn")


class WorkerError(Exception):
    def __init__(self, rank, exc_type, message, tb):
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n{tb}")
        self.rank, self.exc_type, self.message = rank, exc_type, message


def _entry(fn, rank, world_size, tmpdir, pg_timeout, args):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = os.path.join(tmpdir, f"result.{rank}")
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rendezvous", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        try:
            res = ("ok", fn(rank, world_size, *args))
        finally:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        res = ("error", (type(e).__name__, str(e), traceback.format_exc()))
    with open(out + ".tmp", "wb") as f:
        pickle.dump(res, f)
    os.replace(out + ".tmp", out)


def run_workers(world_size, fn, *args, timeout=120, pg_timeout=60, raise_errors=True):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes.

    Returns the per-rank results (``raise_errors=False``: per-rank
    ``("ok", value)`` or ``("error", (type, message, traceback))``).
    """
    with tempfile.TemporaryDirectory(prefix="gtopk-test-") as tmpdir:
        procs = [_CTX.Process(target=_entry, args=(fn, r, world_size, tmpdir, pg_timeout, args),
                              daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        for p in procs:
            left = (deadline - datetime.datetime.now()).total_seconds()
            p.join(max(0.1, left))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"workers {hung} of {world_size} did not finish within {timeout} s")
        results = []
        for r in range(world_size):
            path = os.path.join(tmpdir, f"result.{r}")
            if not os.path.exists(path):
                results.append(("error", ("Died", f"exit code {procs[r].exitcode}", "")))
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    if raise_errors:
        for r, (status, val) in enumerate(results):
            if status != "ok":
                raise WorkerError(r, *val)
        return [v for _, v in results]
    return results
