"""The handler's parts alone, on the in-memory coordinator (its watches call back synchronously):
the control keys' watch (:class:`~elasticd.rendezvous.control.ControlWatch`) and the handler's
use of its trust (:mod:`elasticd.rendezvous.trust`). The contract tests run them on real etcd
(tests/integration/test_rendezvous_native.py)."""

from __future__ import annotations

from elasticd.coordination.api import Compacted, KeyValue, Unavailable
from elasticd.rendezvous.config import HandlerSettings
from elasticd.rendezvous.control import AgentContext, Control, ControlWatch
from elasticd.rendezvous.grace import OutageGrace
from elasticd.rendezvous.handler import EtcdNativeRendezvousHandler
from elasticd.rendezvous.records import RoundRecord, Waiting
from elasticd.testing.clock import FakeClock
from elasticd.testing.coordination import MemoryCoordinator


def test_a_control_watch_error_asks_for_a_listing_and_only_a_broken_watch_is_distrusted():
    coord = MemoryCoordinator()
    control = Control(b"/r/native/", FakeClock())
    distrusted, woken = [], []
    watch = ControlWatch(AgentContext(coord, control, OutageGrace(), FakeClock(), "a",
                                      distrusted.append, lambda: woken.append(1)))
    watch.relist()
    coord.put(control.round_key, RoundRecord(0, ("a",)).encode())
    assert control.round == RoundRecord(0, ("a",)) and watch.events == 1
    watch.stop()  # events from here on are missed
    coord.put(control.round_key, RoundRecord(1, ("a",)).encode())
    watch._on_watch(Compacted(5))
    assert watch.stale.is_set() and distrusted == [] and woken == [1]
    watch.relist_if_stale()  # the listing brings what the watch missed, and watches again
    assert not watch.stale.is_set() and control.round.round == 1
    coord.put(control.round_key, RoundRecord(2, ("a",)).encode())
    assert control.round.round == 2
    watch._on_watch(Unavailable("etcd went away"))
    assert watch.stale.is_set() and distrusted == ["rendezvous watch: etcd went away"]
    watch.stop()


def test_while_it_distrusts_its_view_the_agent_counts_no_member_gone():
    clock = FakeClock()
    handler = EtcdNativeRendezvousHandler(MemoryCoordinator(), b"/r/",
                                          HandlerSettings("job", 1, 2, liveness_ttl=3),
                                          "10.0.0.1", clock=clock)
    control = handler._control
    control.set(KeyValue(control.round_key, RoundRecord(0, (handler.me, "b")).encode(), 1, 1))
    control.set(KeyValue(control.waiting_key, Waiting(0, dead=("b",)).encode(), 2, 2))
    assert handler.gone_members() == ["b"]
    handler._trust.distrust("the rendezvous lease was lost")
    assert handler.gone_members() == []
    clock.advance(6)
    assert handler.gone_members() == ["b"]
    handler.stop()


def test_a_listing_the_watch_overtook_is_no_alarm_and_loses_no_event(caplog):
    """A listing answers at revision r while the watch already brought r + 1 (it ran during the
    listing): that is a race, not etcd going back. No "went back" warning, and the copy still
    has the r + 1 write (the load dropped it: the watch starts again from the listing)."""
    coord = MemoryCoordinator()
    control = Control(b"/r/native/", FakeClock())
    watch = ControlWatch(AgentContext(coord, control, OutageGrace(), FakeClock(), "a",
                                      lambda _: None, lambda: None))
    watch.relist()
    coord.put(control.round_key, RoundRecord(0, ("a",)).encode())
    listing = coord.get_prefix

    def overtaken(prefix):
        kvs, revision = listing(prefix)
        coord.put(control.round_key, RoundRecord(1, ("a",)).encode())  # the watch applies it
        return kvs, revision

    coord.get_prefix = overtaken
    with caplog.at_level("WARNING", logger="elasticd"):
        watch.relist()
    coord.get_prefix = listing
    assert "went back" not in caplog.text
    assert control.round == RoundRecord(1, ("a",))
    watch.stop()


def test_a_members_death_is_told_to_whoever_listens_for_changes_at_once():
    """An in-process agent's monitor wakes on the change (handler.on_change) instead of
    learning it at its next poll (bench/results/recovery_inprocess.json: to_learned)."""
    handler = EtcdNativeRendezvousHandler(MemoryCoordinator(), b"/r/",
                                          HandlerSettings("job", 1, 2, liveness_ttl=3),
                                          "10.0.0.1", clock=FakeClock())
    told = []
    handler.on_change(lambda: told.append(handler.gone_members()))
    control = handler._control
    control.set(KeyValue(control.round_key, RoundRecord(0, (handler.me, "b")).encode(), 1, 1))
    control.set(KeyValue(control.waiting_key, Waiting(0, dead=("b",)).encode(), 2, 2))
    assert told[-1] == ["b"]  # called after the change, which its caller then reads
    handler.stop()
