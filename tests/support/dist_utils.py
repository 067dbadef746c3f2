"""Real torch.distributed gloo process groups for tests, through the
project's one launcher (:func:`gtopk_plugin._launch.launcher.run`).

Rendezvous goes through a file store in a fresh temporary directory (no fixed
port numbers; gloo's own sockets use ephemeral ports).  Every worker's return
value or exception comes back to the parent; a worker that does not finish
within ``timeout`` seconds fails the test and all workers are killed.
"""
from __future__ import annotations

from gtopk_plugin._launch import launcher as launch

WorkerError = launch.WorkerError


def _rank_world(ctx, fn, *args):
    """The tests' worker convention: ``fn(rank, world_size, *args)``."""
    return fn(ctx.rank, ctx.size, *args)


def run_workers(world_size, fn, *args, timeout=120, pg_timeout=60, raise_errors=True):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes.

    Returns the per-rank results (``raise_errors=False``: per-rank
    ``("ok", value)`` or ``("error", (type, message, traceback))``, after
    every rank has finished: tests of failures look at the survivors).  With
    ``raise_errors`` the first failing rank stops the job and raises
    :class:`WorkerError`.
    """
    return launch.run(world_size, _rank_world, fn, *args, timeout=timeout, pg_timeout=pg_timeout,
                      fail_fast=raise_errors, raise_errors=raise_errors)
