"""``import gtopk_plugin.byteps``: the elastic consistency scheduler on BytePS,
configured the BytePS way -- environment variables, overridden by keyword
arguments::

    import byteps.torch as bps
    from gtopk_plugin.byteps import ElasticScheduler

    bps.init()
    sched = ElasticScheduler(model, torch.optim.SGD(model.parameters(), lr=0.1))

``BYTEPS_ELASTIC_POLICY``, ``BYTEPS_ELASTIC_BETA``,
``BYTEPS_ELASTIC_MAX_STALENESS`` (validated in :mod:`gtopk_plugin.config`):
a keyword wins over the variable, the variable over the default.  Imports
without BytePS; building a scheduler without it raises an ``ImportError``
naming the install command.  Not yet run against a real BytePS (0.2.5 needs
a CUDA GPU at start-up): see docs/byteps.md.
"""
from __future__ import annotations

from typing import Optional

from gtopk_plugin import config
from gtopk_plugin.elastic import ElasticScheduler as _ElasticScheduler
from gtopk_plugin.frameworks.byteps_reduction import INSTALL_HINT, BytePSDenseReduction

__all__ = ["ElasticScheduler", "BytePSDenseReduction", "elastic_settings", "INSTALL_HINT"]

_DEFAULTS = {"policy": "norm", "beta": 0.5, "max_staleness": 1}


def elastic_settings(policy: Optional[str] = None, beta: Optional[float] = None,
                     max_staleness: Optional[int] = None) -> dict:
    """The (policy, beta, max_staleness) in force: keyword, else
    ``BYTEPS_ELASTIC_*``, else default.  Raises ``ValueError`` naming a
    variable that is set to an invalid value."""
    env = config.env_byteps_elastic()
    given = {"policy": policy, "beta": beta, "max_staleness": max_staleness}
    return {k: (given[k] if given[k] is not None else env.get(k, _DEFAULTS[k])) for k in _DEFAULTS}


def ElasticScheduler(model, optimizer, *, policy: Optional[str] = None, beta: Optional[float] = None,
                     max_staleness: Optional[int] = None, variance_factor: float = 1.0,
                     prefix: str = "gtopk.elastic", timeout: Optional[float] = None, bps=None):
    """A :class:`gtopk_plugin.elastic.ElasticScheduler` whose reductions are
    BytePS push-pulls (dense average).  ``bps``: the ``byteps.torch`` module
    (default: imported; ``ImportError`` naming ``pip install byteps`` when
    absent)."""
    settings = elastic_settings(policy, beta, max_staleness)
    backend = BytePSDenseReduction(prefix=prefix, timeout=timeout, bps=bps)
    return _ElasticScheduler(model, optimizer, transport=backend, variance_factor=variance_factor, **settings)
