"""Elastic consistency scheduler (Nadiradze, Markov et al. 2020, arXiv
2001.05918): each layer's reduced gradient is applied as soon as it arrives,
and a layer's forward pass at step t+1 waits for its step-t update only until
the step's barrier is broken (norm-bounded or variance-bounded), never more
than ``max_staleness`` steps behind.

Framework-neutral (docs/design.md §1): this package imports no framework; the
framework layers provide :class:`AsyncReduction` back ends
(``gtopk_plugin.elastic.torch_backend``, ``.horovod.elastic``,
``.byteps``).  See docs/elastic.md.
"""
from gtopk_plugin.elastic.backend import AsyncReduction, UnitSpec, register_default, register_transport
from gtopk_plugin.elastic.policies import BarrierPolicy, NormPolicy, Policy, VariancePolicy
from gtopk_plugin.elastic.scheduler import ElasticScheduler
from gtopk_plugin.elastic.settings import ElasticConfig
from gtopk_plugin.elastic.scheduler_stats import BreakRecord, ElasticStats
from gtopk_plugin.elastic.threaded import ThreadedReduction, TransportDenseReduction

__all__ = ["ElasticScheduler", "ElasticConfig", "ElasticStats", "BreakRecord", "AsyncReduction",
           "UnitSpec", "ThreadedReduction", "TransportDenseReduction", "Policy", "BarrierPolicy",
           "NormPolicy", "VariancePolicy", "register_transport", "register_default"]
