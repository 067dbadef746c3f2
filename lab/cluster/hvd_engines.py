"""The Horovod engines of the emulated cluster's jobs: run by
:func:`gtopk_plugin._launch.launcher.run` on every rank (engine
``"lab.cluster.hvd_engines:HorovodEngine"``), so Horovod is imported here,
never in the package's launcher.

- ``horovod``: ``hvd.init()`` with Horovod's gloo controller, whose
  rendezvous the caller started, and ``HorovodTransport(side_channel=True)``:
  the exchange on the gloo side channel, as the Horovod optimizer runs it;
- ``horovod-ops``: the same with every exchange step a Horovod collective
  (``HorovodTransport()``: what ``exchange="horovod"`` and a NCCL-built
  Horovod use).
"""
from __future__ import annotations

from gtopk_plugin._launch import launcher as _launch


class HorovodEngine:
    """Engine ``horovod`` of :func:`gtopk_plugin._launch.launcher.run`: ``hvd.init()``
    on Horovod's gloo controller (rendezvous from the environment the caller
    passes), its barrier, ``HorovodTransport`` and ``hvd.shutdown()``.

    ``side_channel``: the transport moves the exchange on its gloo side
    channel (the optimizer's default) rather than as Horovod
    ops; the byte counts are the same either way."""

    side_channel = True

    def init(self, ctx) -> None:
        import horovod.torch as hvd

        hvd.init()
        if hvd.rank() != ctx.rank or hvd.size() != ctx.size:
            raise RuntimeError(f"Horovod says rank {hvd.rank()}/{hvd.size()}, the launcher "
                               f"started rank {ctx.rank}/{ctx.size}")
        self.hvd = hvd

    def transport(self):
        from gtopk_plugin.frameworks.horovod import HorovodTransport

        return HorovodTransport(side_channel=self.side_channel)

    def barrier(self) -> None:
        # waited with sleeps: Horovod's own barrier spins (waiting.barrier)
        from gtopk_plugin.frameworks.horovod.waiting import barrier

        barrier()

    def shutdown(self) -> None:
        self.hvd.shutdown()


class HorovodOpsEngine(HorovodEngine):
    """Engine ``horovod-ops``: every exchange step a Horovod collective
    (one ``hvd.alltoall`` per butterfly round, ``hvd.allgather``...)."""

    side_channel = False




#: Engine names of the cluster's jobs that run Horovod, and the launcher engine of each.
ENGINES = {"horovod": _launch.target_name(HorovodEngine), "horovod-ops": _launch.target_name(HorovodOpsEngine)}
HOROVOD_ENGINES = tuple(ENGINES)


def launcher_engine(engine: str) -> str:
    """What :func:`gtopk_plugin.bench.bench_launch.run_workers` takes for ``engine``."""
    return ENGINES.get(engine, engine)
