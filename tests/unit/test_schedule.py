"""The butterfly schedule (gtopk_plugin/collectives/schedule.py), shared by
the torch and TensorFlow butterflies: for every P, sends and receives pair
up phase by phase, every rank < P' meets every other rank < P' once through
its group, exactly one rank owns each group's rounding per round, and the
message-round count is the one the statistics report (docs/design.md §2)."""
import pytest

from gtopk_plugin.collectives.schedule import butterfly_schedule, message_rounds


@pytest.mark.parametrize("P", list(range(1, 18)) + [31, 32, 33])
def test_schedule_pairs_up_and_owns_each_rounding_once(P):
    scheds = [butterfly_schedule(P, r) for r in range(P)]
    Pp = 1 << (P.bit_length() - 1)
    folded = P != Pp
    assert all(s.core == Pp and s.folded == folded and s.in_core == (s.rank < Pp) for s in scheds)
    for phase in ("fold_in", "fold_out"):
        for s in scheds:
            ph = getattr(s, phase)
            assert (ph is None) == (not folded)
            if ph is None:
                continue
            if ph.send_to is not None:
                assert getattr(scheds[ph.send_to], phase).recv_from == s.rank
            if ph.recv_from is not None:
                assert getattr(scheds[ph.recv_from], phase).send_to == s.rank
        if folded:  # ranks >= P' fold into r - P' and get the result back
            assert {s.rank for s in scheds if getattr(s, phase).send_to is not None} == \
                (set(range(Pp, P)) if phase == "fold_in" else set(range(P - Pp)))
    n_rounds = Pp.bit_length() - 1
    groups = [{r} for r in range(Pp)]
    for j in range(n_rounds):
        owners = 0
        for s in scheds:
            rnd = s.rounds[j]
            assert rnd.j == j
            if s.rank >= Pp:
                assert rnd.peer is None and not rnd.owns_rounding
                continue
            assert scheds[rnd.peer].rounds[j].peer == s.rank and rnd.peer != s.rank
            # the owner is the lowest rank of r's group before round j
            assert rnd.owns_rounding == (s.rank == min(groups[s.rank]))
            owners += rnd.owns_rounding
        assert owners == Pp >> j  # one per group
        groups = [groups[r] | groups[scheds[r].rounds[j].peer] for r in range(Pp)]
    assert all(g == set(range(Pp)) for g in groups)  # everyone met everyone
    assert [s.owns_final_rounding for s in scheds] == [r == 0 for r in range(P)]
    assert message_rounds(P) == n_rounds + (2 if folded else 0)


def test_schedule_rejects_a_rank_outside_the_world():
    for P, r in ((0, 0), (3, 3), (3, -1)):
        with pytest.raises(ValueError):
            butterfly_schedule(P, r)
