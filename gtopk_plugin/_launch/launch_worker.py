"""The worker side of :mod:`gtopk_plugin._launch.launcher`: what runs in each rank's
process, and how a target is named across processes.

A worker starts as ``python -u -c BOOTSTRAP ENV_JSON PACKAGE_PARENT SPEC
RANK``: it sets the environment the launcher asked for (before anything
imports torch: ``OMP_NUM_THREADS``, ``GLOO_SOCKET_IFNAME`` and an engine's
variables are read when those libraries start), takes the launcher's
``sys.path``, joins the group, calls ``target(ctx, *args)`` and writes
``("ok", value)`` or ``("error", (type, message, traceback))`` for the
launcher to collect.
"""
from __future__ import annotations

import datetime
import importlib
import importlib.util
import json
import os
import pickle
import sys
import traceback
from typing import Callable, Union

PROGRESS_TAG = "@@progress "


def target_name(target: Union[str, Callable]) -> str:
    """``"module:qualname"`` of a module-level function or class (a string
    passes through).  A target defined in a program run with ``python -m
    pkg.mod`` is named by ``pkg.mod``; in a script run by path, by the
    script's file (``/path/script.py:name``)."""
    if isinstance(target, str):
        return target
    mod = target.__module__
    if mod == "__main__":
        main = sys.modules["__main__"]
        spec = getattr(main, "__spec__", None)
        mod = spec.name if spec is not None else os.path.abspath(main.__file__)
    return f"{mod}:{target.__qualname__}"


def resolve_target(name: str):
    """The object a :func:`target_name` names, imported (a script by path is
    loaded as a module of its own, without running its ``__main__`` block)."""
    mod_name, _, attr = name.rpartition(":")
    if mod_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location("__gtopk_launch_main__", mod_name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(mod_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# ``python -u -c _BOOTSTRAP ENV_JSON PACKAGE_PARENT SPEC RANK`` (see the
# module docstring): the environment first, then this package, then main().
_BOOTSTRAP = ("import json, os, sys; os.environ.update(json.loads(sys.argv[1])); "
              "sys.path.insert(0, sys.argv[2]); "
              "from gtopk_plugin._launch.launch_worker import main; main(sys.argv[3], int(sys.argv[4]))")
# where this package is imported from (a checkout need not be installed)
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class WorkerContext:
    """What a target gets: ``rank``, ``size``, ``engine``, ``timeout`` (the
    collective timeout), ``barrier()``, ``transport`` (a gtopk_plugin
    Transport on the engine's group) and ``progress(**fields)`` (rank 0's
    messages, forwarded to the launcher's ``progress`` callback)."""

    def __init__(self, rank: int, size: int, engine: str, timeout: float, progress: bool = False):
        self.rank, self.size, self.engine, self.timeout = rank, size, engine, timeout
        self._progress = progress
        self._transport = None
        self._engine = None
        if engine not in ("torch", "none"):
            self._engine = resolve_target(engine)()

    def init(self, rendezvous: str) -> None:
        import torch

        torch.set_num_threads(1)
        if self.engine == "torch":
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=rendezvous, rank=self.rank, world_size=self.size,
                                    timeout=datetime.timedelta(seconds=self.timeout))
        elif self._engine is not None:
            self._engine.init(self)

    @property
    def transport(self):
        if self._transport is None:
            if self.engine == "torch":
                from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport

                self._transport = TorchDistributedTransport(timeout=self.timeout)
            elif self._engine is not None:
                self._transport = self._engine.transport()
            else:
                raise RuntimeError("engine 'none' has no transport")
        return self._transport

    def barrier(self) -> None:
        if self.engine == "torch":
            import torch.distributed as dist

            dist.barrier()
        elif self._engine is not None:
            self._engine.barrier()

    def progress(self, **fields) -> None:
        if self._progress and self.rank == 0:
            print(PROGRESS_TAG + json.dumps(fields), flush=True)

    def shutdown(self) -> None:
        if self.engine == "torch":
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        elif self._engine is not None:
            self._engine.shutdown()


def main(spec_path: str, rank: int) -> None:  # pragma: no cover - runs in the workers
    """One rank: join, run the target, write the result, leave."""
    with open(spec_path, "rb") as f:
        # the launcher's sys.path first: the pickled arguments may reference
        # modules only it can find (as multiprocessing's spawn does)
        sys.path[:] = pickle.load(f)
        spec = pickle.load(f)
    out = os.path.join(spec["outdir"], f"result.{rank}")
    status = 1
    try:
        ctx = WorkerContext(rank, spec["world"], spec["engine"], spec["pg_timeout"], spec["progress"])
        ctx.init(spec["rendezvous"])
        res = ("ok", resolve_target(spec["target"])(ctx, *spec["args"]))
        status = 0
    except BaseException as e:  # noqa: BLE001 - everything goes back to the launcher
        res = ("error", (type(e).__name__, str(e), traceback.format_exc()))
    try:
        _write(out, res)
    except Exception as e:  # noqa: BLE001 - an unpicklable result is this rank's error
        status = 1
        _write(out, ("error", (type(e).__name__, f"result not picklable: {e}", traceback.format_exc())))
    if status == 0:
        try:
            ctx.shutdown()
        except Exception:  # noqa: BLE001 - the result is written; teardown is best effort
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: after a failure it may wait on dead peers,
    # and torch's teardown alone takes seconds per process.
    os._exit(status)


def _write(path: str, res) -> None:
    with open(path + ".part", "wb") as f:
        pickle.dump(res, f)
    os.replace(path + ".part", path)
