"""Per-call statistics of a reduction (``GradientReducer.last_stats``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict


@dataclass
class ReduceStats:
    """What one ``reduce()`` call did on this rank.

    ``bytes_sent`` / ``bytes_received`` = payload + size headers of the data
    path; ``control_bytes`` is the per-call consistency check, reported
    apart.  ``dense_bytes`` is what a ring allreduce of the same gradients
    would send per worker, 2·(P−1)/P·bytes(N), for side-by-side ratios.
    """

    method: str
    aggregation: str
    step: int
    world_size: int
    numel: int
    k: int
    density: float
    selected: int = 0
    result_nnz: int = 0
    sent_entries: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    payload_bytes_sent: int = 0
    payload_bytes_received: int = 0
    header_bytes_sent: int = 0
    header_bytes_received: int = 0
    control_bytes: int = 0
    messages_sent: int = 0
    rounds: int = 0
    dense_bytes: int = 0
    skipped: bool = False
    seconds: Dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_counters(cls, d, *, dtype, **fields) -> "ReduceStats":
        """Stats of a call whose traffic is ``d`` (a ``TrafficCounters``
        difference over the call) on gradients of ``dtype``; ``fields``:
        the rest (method, numel, k, ...)."""
        import torch

        P, numel = fields["world_size"], fields["numel"]
        esz = torch.empty(0, dtype=dtype).element_size()
        return cls(
            bytes_sent=d.payload_bytes_sent + d.header_bytes_sent,
            bytes_received=d.payload_bytes_received + d.header_bytes_received,
            payload_bytes_sent=d.payload_bytes_sent, payload_bytes_received=d.payload_bytes_received,
            header_bytes_sent=d.header_bytes_sent, header_bytes_received=d.header_bytes_received,
            control_bytes=d.control_bytes, messages_sent=d.messages_sent,
            dense_bytes=(2 * (P - 1) * numel * esz) // P, **fields)

    def as_dict(self) -> dict:
        return asdict(self)
