"""TransferStatus (decode side): upstream's fields (``received_kvs_per_pp``,
``expected_kvs_per_pp``, ``num_pp_ranks_expected``, ``received_state_per_pp``, ``received_aux``)
keyed by the sender's ENGINE rank; a room is done only when every expected sender reported,
KV and state senders counted apart; notifications a room does not expect are refused."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.disaggregation.common.messages import Notif, NotifKind
from sglang.srt.disaggregation.nixl.conn import TransferStatus
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

ROOM = 9


def kv(rank, chunk, last):
    return Notif(ROOM, NotifKind.KV, rank, chunk, last)


def test_pp1_two_prefill_tp_ranks_both_counted_by_engine_rank():
    # regression of upstream PR #22145: with PP=1 both prefill TP ranks were pp rank 0, so the
    # second one's chunks landed on the first one's key and the room never completed
    status = TransferStatus.expecting(kv_senders={0, 1}, state_senders=set(), aux_sender=0)
    assert status.num_pp_ranks_expected == 2 and not status.expects_state
    status.record(kv(1, 1, True))  # out of order: last chunk first
    status.record(kv(0, 0, True))
    status.record(Notif(ROOM, NotifKind.AUX, 0))
    assert status.received_kvs_per_pp == {0: {0}, 1: {1}}
    assert status.expected_kvs_per_pp == {0: 1, 1: 2}
    assert not status.is_done() and status.missing() == "KV from engine rank 1"
    status.record(kv(1, 0, False))
    assert status.is_done() and status.num_received == 4


def test_a_second_sender_on_the_same_key_is_refused_not_merged():
    # what the pp-rank key did silently: a second sender's chunk 0 on key 0
    status = TransferStatus.expecting(kv_senders={0, 1}, state_senders=set(), aux_sender=0)
    status.record(kv(0, 0, True))
    with pytest.raises(ValueError, match="unexpected KV chunk 0 from engine rank 0"):
        status.record(kv(0, 0, True))
    assert status.received_kvs_per_pp == {0: {0}}


def test_state_senders_are_counted_apart_from_kv_senders():
    # MLA with Tp 2 -> Td 1: KV (replicated latents) and aux from engine rank 0 only, each
    # rank's state shard from both
    status = TransferStatus.expecting(kv_senders={0}, state_senders={0, 1}, aux_sender=0)
    assert status.num_pp_ranks_expected == 1 and status.num_state_senders_expected == 2
    status.record(kv(0, 0, True))
    status.record(Notif(ROOM, NotifKind.AUX, 0))
    status.record(Notif(ROOM, NotifKind.STATE, 0))
    assert not status.is_done() and status.missing() == "state from engine rank 1"
    with pytest.raises(ValueError, match=r"KV from engine rank 1, expected \[0\]"):
        status.record(kv(1, 0, True))  # a state-only sender sending KV
    status.record(Notif(ROOM, NotifKind.STATE, 1))
    assert status.received_state_per_pp == {0, 1} and status.is_done()


def test_state_is_not_counted_as_kv_nor_kv_as_state():
    status = TransferStatus.expecting(kv_senders={0, 1}, state_senders={0, 1}, aux_sender=0)
    for notif in (kv(0, 0, True), kv(1, 0, True), Notif(ROOM, NotifKind.STATE, 0), Notif(ROOM, NotifKind.AUX, 0)):
        status.record(notif)
    assert not status.is_done()  # all KV in, one state missing
    status2 = TransferStatus.expecting(kv_senders={0, 1}, state_senders={0, 1}, aux_sender=0)
    for notif in (kv(0, 0, True), Notif(ROOM, NotifKind.STATE, 0), Notif(ROOM, NotifKind.STATE, 1),
                  Notif(ROOM, NotifKind.AUX, 0)):
        status2.record(notif)
    assert not status2.is_done() and status2.missing() == "KV from engine rank 1"


@pytest.mark.parametrize("notif,match", [
    (kv(5, 0, True), "KV from engine rank 5, expected"),
    (Notif(ROOM, NotifKind.AUX, 1), "unexpected aux from engine rank 1"),
    (Notif(ROOM, NotifKind.STATE, 0), "unexpected state from engine rank 0"),
])
def test_notifications_from_unexpected_senders_are_refused(notif, match):
    status = TransferStatus.expecting(kv_senders={0, 1}, state_senders=set(), aux_sender=0)
    with pytest.raises(ValueError, match=match):
        status.record(notif)
    assert status.num_received == 0


def test_chunks_repeated_or_past_the_last_are_refused():
    status = TransferStatus.expecting(kv_senders={0}, state_senders={0}, aux_sender=None)
    status.record(kv(0, 0, False))
    with pytest.raises(ValueError, match="unexpected KV chunk 0"):
        status.record(kv(0, 0, False))
    status.record(kv(0, 1, True))
    with pytest.raises(ValueError, match="unexpected KV chunk 2"):
        status.record(kv(0, 2, False))
    assert not status.is_done()  # state still missing
    status.record(Notif(ROOM, NotifKind.STATE, 0))
    assert status.is_done()
    early = TransferStatus.expecting({0}, set(), None)
    early.record(kv(0, 1, False))
    with pytest.raises(ValueError, match="last chunk 0 below a received one"):
        early.record(kv(0, 0, True))


def test_rank_without_aux_buffers_needs_no_aux_and_refuses_one():
    status = TransferStatus.expecting(kv_senders={3}, state_senders=set(), aux_sender=None)
    assert not status.expects_aux
    status.record(kv(3, 0, True))
    assert status.is_done()
    with pytest.raises(ValueError, match="unexpected aux from engine rank 3"):
        status.record(Notif(ROOM, NotifKind.AUX, 3))


@pytest.mark.parametrize("fields,done", [
    ({}, False),  # nothing known: never done
    ({"received_aux": True, "expected_kvs_per_pp": {0: 0}}, False),  # sender count unknown
    ({"num_pp_ranks_expected": 1, "expected_kvs_per_pp": {0: 0}}, False),  # aux missing
    ({"num_pp_ranks_expected": 1, "received_aux": True, "expected_kvs_per_pp": {0: 0}}, True),  # zero pages
    ({"num_pp_ranks_expected": 2, "received_aux": True, "expected_kvs_per_pp": {0: 0}}, False),  # one unheard
    ({"num_pp_ranks_expected": 1, "received_aux": True, "expected_kvs_per_pp": {4: 2},
      "received_kvs_per_pp": {4: {0}}}, False),  # chunk 1 of 2 missing
    ({"num_pp_ranks_expected": 1, "received_aux": True, "expected_kvs_per_pp": {4: 2},
      "received_kvs_per_pp": {4: {0, 1}}}, True),
    ({"num_pp_ranks_expected": 2, "received_aux": True, "expected_kvs_per_pp": {0: 0, 1: 0},
      "expects_state": True, "received_state_per_pp": {1}}, False),  # state from every KV sender
    ({"num_pp_ranks_expected": 2, "received_aux": True, "expected_kvs_per_pp": {0: 0, 1: 0},
      "expects_state": True, "received_state_per_pp": {0, 1}}, True),
])
def test_upstream_fields_set_directly_decide_is_done(fields, done):
    # a contributor's code fills the fields itself (no sender names): upstream's semantics
    assert TransferStatus(**fields).is_done() is done


def test_upstream_style_status_files_any_sender_and_counts_them():
    status = TransferStatus(num_pp_ranks_expected=2)
    status.record(kv(7, 0, True))
    status.record(Notif(ROOM, NotifKind.AUX, 7))
    assert not status.is_done() and status.missing() == "KV from 1 more sender(s)"
    status.record(kv(8, 0, True))
    assert status.is_done()


@st.composite
def rooms(draw):
    """Senders, their chunk counts and every notification of one room, in a random order."""
    kv_senders = draw(st.sets(st.integers(0, 7), min_size=1, max_size=4))
    state_senders = draw(st.sets(st.integers(0, 7), max_size=4))
    aux_sender = draw(st.none() | st.sampled_from(sorted(kv_senders)))
    notifs = [Notif(ROOM, NotifKind.STATE, r) for r in state_senders]
    notifs += [Notif(ROOM, NotifKind.AUX, aux_sender)] if aux_sender is not None else []
    for rank in kv_senders:
        n = draw(st.integers(1, 4))
        notifs += [kv(rank, c, c == n - 1) for c in range(n)]
    return kv_senders, state_senders, aux_sender, draw(st.permutations(notifs))


@settings(max_examples=200, deadline=None)
@given(rooms())
def test_done_exactly_when_the_last_expected_notification_is_filed(room):
    kv_senders, state_senders, aux_sender, notifs = room
    status = TransferStatus.expecting(kv_senders, state_senders, aux_sender)
    for i, notif in enumerate(notifs):
        assert not status.is_done(), f"done before {notifs[i:]}"
        status.record(notif)
    assert status.is_done() and status.missing() == "nothing"
    assert status.num_received == len(notifs)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
