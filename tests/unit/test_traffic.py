"""gtopk_plugin.pipeline.traffic.StepTraffic: the one per-step traffic record."""
from gtopk_plugin.collectives.transport import TrafficCounters
from gtopk_plugin.pipeline.reduce_stats import ReduceStats
from gtopk_plugin.pipeline import traffic
from gtopk_plugin.pipeline.traffic import STATS_FIELDS, TRANSPORT_FIELDS, StepTraffic


def _stats(i, skipped=False):
    return ReduceStats(method="gtopk", aggregation="butterfly", step=0, world_size=4, numel=100 * i, k=10 * i,
                       density=0.1, sent_entries=10 * i, bytes_sent=80 * i + 8, bytes_received=80 * i,
                       payload_bytes_sent=80 * i, payload_bytes_received=80 * i, header_bytes_sent=8,
                       header_bytes_received=0, control_bytes=16, messages_sent=2, rounds=2,
                       dense_bytes=600 * i, skipped=skipped)


def test_from_stats_sums_buckets_and_derives_bytes():
    t = StepTraffic.from_stats([_stats(1), _stats(2, skipped=True)])
    assert t.buckets == 2 and t.skipped
    assert (t.numel, t.k, t.sent_entries, t.rounds, t.dense_bytes) == (300, 30, 30, 4, 1800)
    assert (t.payload_bytes_sent, t.header_bytes_sent, t.control_bytes, t.messages_sent) == (240, 16, 32, 4)
    # bytes_* = payload + headers, as ReduceStats.bytes_* (the consistency check stays apart)
    assert t.bytes_sent == _stats(1).bytes_sent + _stats(2).bytes_sent
    assert t.bytes_received == _stats(1).bytes_received + _stats(2).bytes_received


def test_counters_override_transport_fields():
    c = TrafficCounters(payload_bytes_sent=7, payload_bytes_received=5, header_bytes_sent=1,
                        header_bytes_received=2, control_bytes=3, messages_sent=4)
    t = StepTraffic.from_stats([_stats(1)], counters=c)
    assert [getattr(t, f) for f in TRANSPORT_FIELDS] == [7, 5, 1, 2, 3, 4]
    assert (t.k, t.numel, t.buckets) == (10, 100, 1)
    assert t.bytes_sent == 8 and t.bytes_received == 7


def test_add_records_and_as_dict_keys():
    a = StepTraffic.from_stats([_stats(1)])
    b = StepTraffic.from_stats([_stats(2)])
    s = StepTraffic().add(a).add(b)
    assert s == StepTraffic.from_stats([_stats(1), _stats(2)])
    d = s.as_dict()
    for key in TRANSPORT_FIELDS + STATS_FIELDS + ("bytes_sent", "bytes_received", "buckets", "skipped"):
        assert key in d
    assert d["bytes_sent"] == s.bytes_sent and isinstance(d, dict)


def test_ring_allreduce_model():
    t = StepTraffic.ring_allreduce(4, wire_bytes=1000, grad_bytes=2000)
    assert t.bytes_sent == t.bytes_received == 2 * 3 * 1000 // 4
    assert t.dense_bytes == 2 * 3 * 2000 // 4
    assert t.header_bytes_sent == 0 and t.control_bytes == 0
    assert StepTraffic.ring_allreduce(1, 1000, 1000).bytes_sent == 0


def test_exact_predictions_per_wire():
    """The formulas the collectives' counters are asserted against
    (tests/distributed/test_wire_int8.py): int8 messages are 5·k + 1 bytes."""
    K, m8, m32, mask = 1000, 5 * 1000 + 1, 8 * 1000, 125
    assert traffic.gtopk_bytes(4, 0, K, "int8") == (2 * m8, 2 * m8)
    assert traffic.gtopk_bytes(4, 3, K, "fp32") == (2 * m32, 2 * m32)
    # P = 3: rank 2 folds into rank 0, which sends it the result and a bitmask
    assert traffic.gtopk_bytes(3, 0, K, "int8") == (2 * m8 + mask, 2 * m8)
    assert traffic.gtopk_bytes(3, 1, K, "int8") == (m8, m8)
    assert traffic.gtopk_bytes(3, 2, K, "int8") == (m8, m8 + mask)
    assert traffic.gtopk_bytes(1, 0, K, "int8") == (0, 0)
    assert traffic.allgather_bytes(4, K, "int8") == 3 * m8
    # sharded value sum of 10 int8 values over P = 3 (shards 3, 3, 4): 4 messages each way
    assert traffic.sharded_allreduce_bytes(3, 0, 10, "int8") == ((3 + 4) + (4 + 3) + 4, 2 * 3 + (3 + 4) + 4)
    for P in (2, 3, 5, 8):
        sent = [traffic.sharded_allreduce_bytes(P, r, 1001, "int8") for r in range(P)]
        assert sum(s for s, _ in sent) == sum(r for _, r in sent)
        gt = [traffic.gtopk_bytes(P, r, K, "int8") for r in range(P)]
        assert sum(s for s, _ in gt) == sum(r for _, r in gt)
