"""Lease liveness of the etcd-v3 rendezvous, on the in-memory coordinator and a fake clock.

The rule itself (:class:`LivenessJudge`): absence confirmed over time, joining nodes spared,
doubt after anything that makes this agent's view of etcd unreliable. Then the alive key's keeper
(lease lost, re-grant, slow and failed calls), and the whole path through torch's real state
holder: a node whose key is gone leaves torch's state at the next sync, and an etcd outage that
expires every lease drops nobody.
"""

from __future__ import annotations

import datetime
import pickle

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
)

from elasticd.clock import FakeClock
from elasticd.coordination.api import Unavailable
from elasticd.coordination.keys import Keyspace
from elasticd.coordination.memory import MemoryCoordinator, MemoryStore
from elasticd.coordination.rendezvous_alive_key import AliveKeyKeeper
from elasticd.coordination.rendezvous_backend import EtcdV3RendezvousBackend
from elasticd.coordination.rendezvous_grace import OutageGrace
from elasticd.coordination.rendezvous_liveness import (
    DEAD_HEARTBEAT,
    LeaseLiveness,
    LivenessJudge,
    node_id,
)
from elasticd.coordination.rendezvous_standby import ParkWaitingNodesWhenFull

RUN_ID = "job-1"
TTL = 3
ALIVE = Keyspace("/t").job_rdzv(RUN_ID) + b"alive/"


# -- the rule -----------------------------------------------------------------------------


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def judge(clock):
    return LivenessJudge(ttl=TTL, confirm=1.0, clock=clock)


def test_node_id_is_torchs_node_desc_and_one_path_element():
    assert node_id(_NodeDesc("10.0.0.1", 42, 0)) == "10.0.0.1_42_0"
    assert "/" not in node_id(_NodeDesc("a/b", 1, 2))
    assert node_id(_NodeDesc("::1", 7, 1)) == "%3A%3A1_7_1"


def test_a_node_whose_key_is_present_is_never_dropped(judge, clock):
    for _ in range(20):
        assert judge.judge({"a", "b"}, {"a", "b"}, "a") == set()
        clock.advance(1)


def test_absence_must_last_the_confirmation_time(judge, clock):
    assert judge.judge({"a", "b"}, {"a", "b"}, "a") == set()  # b seen alive
    clock.advance(1)
    assert judge.judge({"a", "b"}, {"a"}, "a") == set()  # first absent read
    clock.advance(0.5)
    assert judge.judge({"a", "b"}, {"a"}, "a") == set()
    assert judge.missing_for("b") == pytest.approx(0.5)
    clock.advance(0.5)
    assert judge.judge({"a", "b"}, {"a"}, "a") == {"b"}


def test_a_key_that_comes_back_restarts_the_confirmation(judge, clock):
    judge.judge({"a", "b"}, {"a", "b"}, "a")
    judge.judge({"a", "b"}, {"a"}, "a")
    clock.advance(0.9)
    judge.judge({"a", "b"}, {"a", "b"}, "a")  # b re-granted and re-wrote its key
    clock.advance(0.2)
    assert judge.judge({"a", "b"}, {"a"}, "a") == set()
    clock.advance(1)
    assert judge.judge({"a", "b"}, {"a"}, "a") == {"b"}


def test_this_agent_is_never_dropped(judge, clock):
    judge.judge({"a"}, {"a"}, "a")
    clock.advance(100)
    assert judge.judge({"a", "b"}, {"a", "b"}, "a") == set()


def test_a_joining_node_is_spared_until_its_key_could_have_been_written(judge, clock):
    # c entered the state but no read of ours has seen its key yet: it may not have written
    # it (or runs without liveness); it is spared for 2 x TTL from when we first saw it.
    judge.judge({"a"}, {"a"}, "a")
    clock.advance(1)
    for _ in range(5):
        assert judge.judge({"a", "c"}, {"a"}, "a") == set()
        clock.advance(1)
    clock.advance(1)  # 2 x TTL = 6 s since c first appeared
    assert judge.judge({"a", "c"}, {"a"}, "a") == {"c"}


def test_a_node_once_seen_alive_gets_no_join_grace(judge, clock):
    judge.judge({"a", "c"}, {"a", "c"}, "a")
    judge.judge({"a", "c"}, {"a"}, "a")
    clock.advance(1)
    assert judge.judge({"a", "c"}, {"a"}, "a") == {"c"}  # 1 s after c appeared, not 6


def test_doubt_drops_nobody_for_two_ttls_then_absence_is_counted_afresh(judge, clock):
    judge.judge({"a", "b"}, {"a", "b"}, "a")
    judge.judge({"a", "b"}, {"a"}, "a")
    clock.advance(0.5)
    judge.distrust("etcd unreachable")
    assert not judge.trusted
    for _ in range(5):
        clock.advance(1)
        assert judge.judge({"a", "b"}, {"a"}, "a") == set()
    clock.advance(1)  # 6 s = 2 x TTL after the doubt
    assert judge.trusted
    # The absence before and during the doubt does not count: confirmation starts now.
    assert judge.judge({"a", "b"}, {"a"}, "a") == set()
    clock.advance(1)
    assert judge.judge({"a", "b"}, {"a"}, "a") == {"b"}


def test_own_key_missing_is_doubt(judge, clock):
    judge.judge({"a", "b"}, {"a", "b"}, "a")
    clock.advance(1)
    # Every lease expired at once (etcd was paused): ours too. Nothing read now counts.
    assert judge.judge({"a", "b"}, set(), "a") == set()
    assert not judge.trusted
    clock.advance(1)
    assert judge.judge({"a", "b"}, {"a"}, "a") == set()  # we re-wrote ours first


def test_nodes_that_left_the_state_are_forgotten(judge, clock):
    judge.judge({"a", "b"}, {"a", "b"}, "a")
    judge.judge({"a"}, {"a"}, "a")  # b left (torch dropped it, or it exited)
    clock.advance(1)
    # The same id back in the state (it cannot be: ids hold a pid) would be a joining node.
    assert judge.judge({"a", "b"}, {"a"}, "a") == set()


@pytest.mark.parametrize("kwargs", [{"ttl": 0}, {"ttl": 3, "confirm": -1},
                                    {"ttl": 3, "confirm": float("nan")}])
def test_bad_judge_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        LivenessJudge(**kwargs)


# -- the alive key's keeper ---------------------------------------------------------------


class Recorder:
    def __init__(self):
        self.reasons: list[str] = []

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)


@pytest.fixture
def server(clock):
    return MemoryStore(clock)


def test_keeper_writes_its_key_on_a_lease_and_keeps_it(server, clock):
    coordinator = MemoryCoordinator(server)
    doubts = Recorder()
    keeper = AliveKeyKeeper(coordinator, ALIVE + b"me", b"{}", TTL, doubts, clock)
    keeper.establish()
    kv = coordinator.get(ALIVE + b"me")
    assert kv is not None and kv.lease == keeper.lease != 0
    for _ in range(10):  # 10 s of keep-alives every TTL/3
        clock.advance(keeper.interval)
        assert keeper.step() is False
    assert coordinator.get(ALIVE + b"me").lease == kv.lease
    assert doubts.reasons == []


def test_keeper_regrants_and_rewrites_a_lost_lease_and_doubts(server, clock):
    coordinator = MemoryCoordinator(server)
    doubts = Recorder()
    keeper = AliveKeyKeeper(coordinator, ALIVE + b"me", b"{}", TTL, doubts, clock)
    keeper.establish()
    old = keeper.lease
    clock.advance(TTL + 1)  # the agent was frozen, or etcd paused
    assert keeper.step() is True  # lost: the thread re-grants at once
    assert coordinator.get(ALIVE + b"me") is None
    assert any("lost" in r for r in doubts.reasons)
    assert keeper.step() is False
    kv = coordinator.get(ALIVE + b"me")
    assert kv is not None and kv.lease == keeper.lease != old


def test_keeper_doubts_when_etcd_is_unreachable_or_slow(server, clock):
    doubts = Recorder()

    class Slow(MemoryCoordinator):
        def keep_alive(self, lease):
            clock.advance(1.5)  # longer than TTL/3: it waited out a stall
            return super().keep_alive(lease)

    keeper = AliveKeyKeeper(Slow(server), ALIVE + b"me", b"{}", TTL, doubts, clock)
    keeper.establish()
    server.set_available(False)
    assert keeper.step() is False
    assert len(doubts.reasons) == 2 and "unreachable" in doubts.reasons[0]
    server.set_available(True)
    keeper.step()
    assert "took 1.5s" in doubts.reasons[-1]


def test_keeper_rewrites_a_key_deleted_under_a_live_lease(server, clock):
    coordinator = MemoryCoordinator(server)
    keeper = AliveKeyKeeper(coordinator, ALIVE + b"me", b"{}", TTL, Recorder(), clock)
    keeper.establish()
    coordinator.delete(ALIVE + b"me")
    keeper.request_rewrite()
    keeper.step()
    assert coordinator.get(ALIVE + b"me").lease == keeper.lease


def test_keeper_stop_revokes_the_lease_and_the_key_goes(server, clock):
    coordinator = MemoryCoordinator(server)
    keeper = AliveKeyKeeper(coordinator, ALIVE + b"me", b"{}", TTL, Recorder(), clock)
    keeper.establish()
    keeper.stop(revoke=True)
    assert coordinator.get(ALIVE + b"me") is None


# -- through torch's own state holder -----------------------------------------------------


class HookedCoordinator(MemoryCoordinator):
    """The fake, with a hook that runs before each keep-alive reaches the server."""

    before_keep_alive = None

    def keep_alive(self, lease):
        if self.before_keep_alive is not None:
            self.before_keep_alive()
        return super().keep_alive(lease)


class Agent:
    """One agent's rendezvous side: its etcd client, liveness, backend and torch state holder."""

    def __init__(self, server: MemoryStore, clock: FakeClock, local_id: int,
                 liveness: bool = True, **judge: float) -> None:
        self.node = _NodeDesc("127.0.0.1", 1000 + local_id, local_id)
        self.coordinator = HookedCoordinator(server)
        grace = OutageGrace(0, clock=clock)
        self.liveness = None
        if liveness:
            self.liveness = LeaseLiveness(self.coordinator, ALIVE, ttl=TTL, confirm=1.0,
                                          grace=grace, background=False)
            for name, value in judge.items():
                setattr(self.liveness.judge, name, value)
            self.liveness.bind(self.node)
        self.backend = EtcdV3RendezvousBackend(self.coordinator, RUN_ID, Keyspace("/t"), grace,
                                               liveness=self.liveness)
        settings = RendezvousSettings(
            RUN_ID, 2, 3, RendezvousTimeout(), keep_alive_interval=datetime.timedelta(seconds=5),
            keep_alive_max_attempt=8)  # the backend's default 40 s window
        self.holder = _BackendRendezvousStateHolder(self.backend, settings, cache_duration=0)

    def keep_alive(self) -> bool:
        return self.liveness.keeper.step()

    def participants(self) -> set[_NodeDesc]:
        self.holder.sync()
        return set(self.holder.state.participants)


def _complete_round(agents: list[Agent], clock: FakeClock) -> None:
    """Writes a complete round of ``agents`` (heartbeats fresh) as torch would."""
    state = _RendezvousState()
    state.complete = True
    now = datetime.datetime.now(datetime.timezone.utc)
    for rank, agent in enumerate(agents):
        state.participants[agent.node] = rank
        state.last_heartbeats[agent.node] = now
    agents[0].backend.set_state(pickle.dumps(state))  # also writes agent 0's alive key
    for agent in agents[1:]:
        agent.backend.get_state()  # each writes its alive key before its first read


def _tick(agents: list[Agent], clock: FakeClock, seconds: float) -> None:
    """Lets ``seconds`` pass with every (living) agent keeping its lease alive."""
    step = TTL / 3
    while seconds > 1e-9:
        clock.advance(min(step, seconds))
        seconds -= step
        for agent in agents:
            if agent.keep_alive():
                agent.keep_alive()


@pytest.fixture
def trio(server, clock):
    agents = [Agent(server, clock, i) for i in range(3)]
    _complete_round(agents, clock)
    for agent in agents:
        agent.participants()  # agents poll the state about once a second: all keys seen
    yield agents
    for agent in agents:
        agent.liveness.stop()


def test_every_agent_writes_its_alive_key_before_its_first_state_call(trio, server):
    keys, _ = MemoryCoordinator(server).get_prefix(ALIVE)
    assert [kv.key for kv in keys] == sorted(ALIVE + node_id(a.node).encode() for a in trio)
    assert all(kv.lease for kv in keys)


def test_a_dead_node_leaves_torchs_state_seconds_after_its_lease_expires(trio, clock):
    a, b, c = trio
    assert a.participants() == {a.node, b.node, c.node}
    survivors = [a, b]  # kill -9 of c: its lease is kept alive no more
    _tick(survivors, clock, TTL + 0.5)  # c's lease expires
    for agent in survivors:  # first absent read: not yet
        assert agent.participants() == {a.node, b.node, c.node}
    _tick(survivors, clock, 1.0)
    # torch's window is 40 s; c's heartbeat is a few seconds old, yet it is gone.
    for agent in survivors:
        assert agent.participants() == {a.node, b.node}


def test_without_liveness_torch_keeps_the_dead_node_for_its_window(server, clock):
    agents = [Agent(server, clock, i, liveness=False) for i in range(3)]
    _complete_round(agents, clock)
    clock.advance(10)
    assert agents[0].participants() == {a.node for a in agents}


def test_an_etcd_pause_longer_than_the_ttl_drops_nobody(trio, server, clock):
    # SIGSTOP of etcd for 2 x TTL + 2 s: every lease has expired when it comes back.
    a, b, c = trio
    server.set_available(False)
    for _ in range(8):
        _tick(trio, clock, 1)  # keep-alives fail: every agent doubts
        with pytest.raises(Exception):
            a.participants()
    server.set_available(True)
    # The worst order: a reads before anybody (itself included) re-wrote a key, then a
    # re-writes, reads while b and c have not, and so on; reads every half second.
    for agent in trio:
        assert agent.participants() == {a.node, b.node, c.node}
    for writer in trio:
        assert writer.keep_alive() is True and writer.keep_alive() is False
        for reader in trio:
            clock.advance(0.5)
            assert reader.participants() == {a.node, b.node, c.node}
    _tick(trio, clock, 10)
    assert {frozenset(x.participants()) for x in trio} == {frozenset({a.node, b.node, c.node})}


def test_without_the_outage_guard_that_pause_drops_healthy_nodes(server, clock):
    # The same pause with the guard switched off (no doubt, no confirmation): a drops b and
    # c, whose keys it reads before they are re-written. This is what the guard is for.
    trio = [Agent(server, clock, i, distrust_for=0.0, confirm=0.0) for i in range(3)]
    _complete_round(trio, clock)
    a, b, c = trio
    assert a.participants() == {a.node, b.node, c.node}
    server.set_available(False)
    clock.advance(2 * TTL + 2)
    server.set_available(True)
    a.keep_alive()
    a.keep_alive()
    assert a.participants() == {a.node}
    for agent in trio:
        agent.liveness.stop()


def test_a_short_pause_that_expires_only_some_leases_drops_nobody(trio, server, clock):
    # c's last keep-alive came 0.9 s before a 2.5 s pause, a's and b's just before it: only
    # c's lease (TTL 3) expires. a's keep-alive, sent during the pause, returns late.
    a, b, c = trio
    clock.advance(0.9)
    a.keep_alive()
    b.keep_alive()
    server.set_available(False)
    clock.advance(1.0)

    def stalled_until_the_pause_ends():
        clock.advance(1.5)  # the pause lasts 2.5 s: a's call took 1.5 s, over TTL/3
        server.set_available(True)

    a.coordinator.before_keep_alive = stalled_until_the_pause_ends
    assert a.keep_alive() is False
    a.coordinator.before_keep_alive = None
    assert not a.liveness.judge.trusted
    assert a.participants() == {a.node, b.node, c.node}  # c's key is gone: a doubts
    assert c.keep_alive() is True and c.keep_alive() is False
    _tick(trio, clock, 8)
    assert a.participants() == {a.node, b.node, c.node}


def test_a_forked_child_does_not_revoke_its_parents_lease(trio, server, monkeypatch):
    a = trio[0]
    monkeypatch.setattr("os.getpid", lambda: -1)  # atexit runs in a forked child too
    a.liveness.stop()
    monkeypatch.undo()
    assert a.liveness.active
    assert MemoryCoordinator(server).get(ALIVE + node_id(a.node).encode()) is not None


def test_liveness_off_when_stopped_and_the_key_is_revoked(trio, server):
    a = trio[0]
    a.liveness.stop()
    assert MemoryCoordinator(server).get(ALIVE + node_id(a.node).encode()) is None
    assert not a.liveness.active


def test_standby_fix_does_not_count_a_participant_marked_dead(trio, server, clock):
    # A full round (max 3) whose participant c is dead and a fourth node waits: the waiting
    # node must stay in the wait list (it takes c's slot), not be parked as a standby.
    a, b, c = trio
    d = Agent(server, clock, 3)
    d.backend.get_state()  # d's alive key
    state = pickle.loads(a.backend.get_state()[0])
    state.wait_list.add(d.node)
    state.last_heartbeats[d.node] = datetime.datetime.now(datetime.timezone.utc)
    state.last_heartbeats[c.node] = DEAD_HEARTBEAT
    park = ParkWaitingNodesWhenFull(max_nodes=3)
    assert pickle.loads(park(pickle.dumps(state))).wait_list == {d.node}
    state.last_heartbeats[c.node] = datetime.datetime.now(datetime.timezone.utc)
    assert pickle.loads(park(pickle.dumps(state))).wait_list == set()  # fix still works
    d.liveness.stop()


def test_backend_calls_that_find_etcd_unreachable_raise_doubt(server, clock):
    coordinator = MemoryCoordinator(server)
    grace = OutageGrace(5, clock=clock)
    liveness = LeaseLiveness(coordinator, ALIVE, ttl=TTL, grace=grace, background=False)
    liveness.bind(_NodeDesc("h", 1, 0))
    backend = EtcdV3RendezvousBackend(coordinator, RUN_ID, Keyspace("/t"), grace,
                                      liveness=liveness)
    backend.set_state(b"x")
    assert liveness.judge.trusted
    server.set_available(False)
    original = clock.sleep

    def sleep_then_heal(seconds):
        original(seconds)
        server.set_available(True)

    clock.sleep = sleep_then_heal  # one failed attempt, then etcd is back
    assert backend.get_state()[0] == b"x"
    assert not liveness.judge.trusted
    liveness.stop()


def test_liveness_needs_a_ttl_etcd_accepts():
    with pytest.raises(ValueError, match="at least 2"):
        LeaseLiveness(MemoryCoordinator(), ALIVE, ttl=1)
    with pytest.raises(ValueError, match="end with"):
        LeaseLiveness(MemoryCoordinator(), b"/no/slash", ttl=3)


def test_unreadable_or_foreign_state_passes_unchanged(trio):
    liveness = trio[0].liveness
    assert liveness.filter(b"not a pickle") == b"not a pickle"
    assert liveness.filter(pickle.dumps({"x": 1})) == pickle.dumps({"x": 1})


def test_a_slow_backend_call_raises_doubt(server, clock):
    # A state read that returns 1.5 s late (etcd stalled, then served it): leases may have
    # expired during the stall, so what the liveness read shows next is not to be trusted.
    class SlowGet(MemoryCoordinator):
        def get(self, key):
            clock.advance(1.5)
            return super().get(key)

    coordinator = SlowGet(server)
    grace = OutageGrace(5, clock=clock)
    liveness = LeaseLiveness(coordinator, ALIVE, ttl=TTL, grace=grace, background=False)
    liveness.bind(_NodeDesc("h", 1, 0))
    backend = EtcdV3RendezvousBackend(coordinator, RUN_ID, Keyspace("/t"), grace,
                                      liveness=liveness)
    backend.set_state(b"x")
    assert liveness.judge.trusted
    backend.get_state()
    assert not liveness.judge.trusted
    liveness.stop()


def _open_round(agents: list[Agent], joined: list[Agent], round_: int,
                last_call: float = 30.0) -> None:
    """Writes an open round ``round_`` that ``joined`` entered, its last call running."""
    state = _RendezvousState()
    state.round = round_
    now = datetime.datetime.now(datetime.timezone.utc)
    state.deadline = now + datetime.timedelta(seconds=last_call)
    for agent in joined:
        state.participants[agent.node] = 0
        state.last_heartbeats[agent.node] = now
    current = agents[0].backend.get_state()
    written = agents[0].backend.set_state(pickle.dumps(state), current[1] if current else None)
    assert written is not None and written[2], "the test's round was not written"


def _deadline(agent: Agent) -> datetime.datetime:
    agent.holder.sync()
    return agent.holder.state.deadline


def test_a_rerendezvous_every_live_agent_joined_ends_its_last_call_at_once(trio, clock):
    a, b, c = trio
    _open_round(trio, [a, b, c], round_=1)
    assert _deadline(a) <= datetime.datetime.now(datetime.timezone.utc)


def test_the_last_call_runs_while_a_live_agent_has_not_joined(trio, clock):
    a, b, c = trio  # c is alive (its key exists) but not in the round yet: it may still come
    _open_round(trio, [a, b], round_=1)
    assert _deadline(a) > datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(
        seconds=20)


def test_after_a_death_the_survivors_round_closes_once_the_dead_key_is_gone(trio, clock):
    a, b, c = trio
    _tick([a, b], clock, TTL + 1.5)  # c was killed: its lease expired, its key is gone
    _open_round(trio, [a, b], round_=2)
    assert _deadline(a) <= datetime.datetime.now(datetime.timezone.utc)


def test_the_first_round_keeps_its_last_call(trio, clock):
    # At a job's start the agents come up at different times; a late one may have no key yet.
    a, b, c = trio
    _open_round(trio, [a, b, c], round_=0)
    assert _deadline(a) > datetime.datetime.now(datetime.timezone.utc)


def test_close_last_call_off_keeps_torchs_behaviour(trio, clock):
    a, b, c = trio
    for agent in trio:
        agent.liveness.close_last_call = False
    _open_round(trio, [a, b, c], round_=1)
    assert _deadline(a) > datetime.datetime.now(datetime.timezone.utc)


def test_a_dead_participant_of_my_complete_round_is_reported_once(trio, clock):
    # The workers of a round may still be starting (waiting for the dead node's ranks in
    # init_process_group): torch does not restart them for a departure; the callback does.
    a, b, c = trio
    broken: list[list[str]] = []
    a.liveness.on_round_broken = broken.append
    _tick([a, b], clock, TTL + 0.5)
    a.participants()
    assert broken == []  # absent once: not yet judged dead
    _tick([a, b], clock, 1.0)
    a.participants()
    assert broken == [[node_id(c.node)]]
    _tick([a, b], clock, 1.0)
    a.participants()
    assert broken == [[node_id(c.node)]]  # once per round


def test_a_dead_node_outside_my_round_breaks_nothing(server, clock):
    # c waits beside a complete round of a and b (wait list), then dies: it is dropped, but
    # the round a and b train in lost nobody, so their workers stay.
    a, b, c = (Agent(server, clock, i) for i in range(3))
    _complete_round([a, b], clock)
    raw, token = a.backend.get_state()
    state = pickle.loads(raw)
    state.wait_list.add(c.node)
    state.last_heartbeats[c.node] = datetime.datetime.now(datetime.timezone.utc)
    c.backend.get_state()  # c writes its alive key
    assert a.backend.set_state(pickle.dumps(state), token)[2]
    for agent in (a, b, c):
        agent.holder.sync()
    assert c.node in a.holder.state.wait_list
    broken: list[list[str]] = []
    a.liveness.on_round_broken = broken.append
    _tick([a, b], clock, TTL + 0.5)
    a.holder.sync()
    _tick([a, b], clock, 1.0)
    a.holder.sync()
    assert c.node not in a.holder.state.wait_list  # judged dead and dropped ...
    assert broken == []  # ... without breaking a's round
    for agent in (a, b, c):
        agent.liveness.stop()
