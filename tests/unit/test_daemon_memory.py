"""The daemon's decisions end to end on the in-memory coordinator and a fake clock: fast and
deterministic twins of the real-etcd tests in tests/integration/test_cluster_failures.py."""

from __future__ import annotations

import pytest

from elasticd.testing.clock import FakeClock
from elasticd.cluster.events import EventLog
from elasticd.config import Settings
from elasticd.coordination.api import CoordinationError
from elasticd.coordination.keys import Keyspace
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
from elasticd.daemon.daemon import Daemon, NodeIdInUse

TTL = 2


@pytest.fixture
def world():
    clock = FakeClock()
    store = MemoryStore(clock)
    daemons = {}

    def start(node, **kw):
        s = Settings(node_id=node, etcd="mem:1", lease_ttl=TTL, loop_interval=0.25,
                     outage_grace=kw.pop("outage_grace", 30.0), **kw)
        d = Daemon(s, MemoryCoordinator(store), clock=clock)
        d.registration.http_address = f"{node}:1"  # as node.py sets it once serving
        d.join(keep_alive_thread=False)
        daemons[node] = d
        return d

    def tick(seconds=0.25, alive=None):
        """Advances time; live daemons keep their leases and run a cycle."""
        clock.advance(seconds)
        for n, d in daemons.items():
            if alive is None or n in alive:
                d.keeper.step()
        store.expire_leases()
        return {n: d.cycle() for n, d in daemons.items() if alive is None or n in alive}

    yield clock, store, start, tick, daemons
    for d in daemons.values():
        d.close()


def events(store, kind=None):
    return [e for e in EventLog(MemoryCoordinator(store), Keyspace("/elasticd")).list()
            if kind is None or e.kind == kind]


def test_failure_recorded_once_and_counted_by_each_survivor(world):
    clock, store, start, tick, daemons = world
    for n in ("n1", "n2", "n3"):
        start(n)
    sentences = tick()
    assert sentences["n1"] == "n2 joined; n3 joined (3 nodes alive)" or "3 nodes alive" in sentences["n1"]
    assert tick()["n1"] == "no action: I am n1, 3 nodes alive"
    for _ in range(int(TTL / 0.25) + 2):  # n2 stops refreshing its lease
        out = tick(alive={"n1", "n3"})
    failed = events(store, "failed")
    assert len(failed) == 1 and failed[0].node == "n2"
    assert failed[0].data["detection_seconds"] >= TTL
    for n in ("n1", "n3"):
        assert daemons[n].metrics.membership.node_failures._value.get() == 1
        assert daemons[n].membership.alive() == sorted({"n1", "n3"})
    assert tick(alive={"n1", "n3"})["n1"] == "no action: I am n1, 2 nodes alive"


def test_clean_leave_is_a_departure(world):
    clock, store, start, tick, daemons = world
    start("n1"), start("n2")
    tick()
    daemons["n2"].leave()
    del daemons["n2"]
    out = tick()
    assert "n2 departed" in out["n1"]
    assert [e.kind for e in events(store) if e.node == "n2"] == ["joined", "left"]
    assert daemons["n1"].metrics.membership.node_departures._value.get() == 1


def test_outage_expiring_every_lease_records_no_failure(world):
    clock, store, start, tick, daemons = world
    for n in ("n1", "n2", "n3"):
        start(n)
    tick()
    store.set_available(False)
    for _ in range(8):  # 2 s of outage: longer than the TTL
        out = tick()
    assert all("etcd unreachable" in s for s in out.values()), out
    assert all(d.metrics.etcd.up._value.get() == 0 for d in daemons.values())
    store.set_available(True)
    store.expire_leases()  # what a resumed etcd does: every lease is past due
    for _ in range(4 * TTL * 4):
        out = tick()
    assert not events(store, "failed"), events(store, "failed")
    assert not events(store, "fenced")
    assert all(d.membership.alive() == ["n1", "n2", "n3"] for d in daemons.values())
    assert all(d.registered_lease is not None for d in daemons.values())
    assert out["n1"] == "no action: I am n1, 3 nodes alive"
    assert sum(d.metrics.membership.provisional_expiries.labels("rejoined")._value.get()
               for d in daemons.values()) > 0


def test_a_joined_daemon_bounds_the_repeats_of_a_refused_request(world):
    clock, store, start, tick, daemons = world
    bounds = []

    class Etcd(MemoryCoordinator):
        def etcd(self):
            return self

        def bound_refusals(self, seconds):
            bounds.append(seconds)

    d = Daemon(Settings(node_id="n1", etcd="mem:1", lease_ttl=TTL, etcd_timeout=0.7),
               Etcd(store), clock=clock)
    try:
        assert bounds == []
        d.join(keep_alive_thread=False)
        assert bounds == [0.7]
    finally:
        d.close()


def test_etcd_refusing_every_request_is_an_outage_the_daemon_reports(world):
    """etcd refusing every request while its users change ("revision of auth store is old",
    past what the adapter repeats once the daemon joined) is an outage of its own kind:
    /status, the metrics, the sentence and the grace know it, and the loop carries on."""
    clock, store, start, tick, daemons = world
    d = start("n1", outage_grace=5.0)
    tick()
    store.set_refusing(True)
    out = tick()
    assert "etcd refuses our requests for" in out["n1"], out
    assert "keeping workers running" in out["n1"]
    st = d.status()
    assert st["etcd_up"] is False and st["etcd_outage_kind"] == "refuses our requests"
    assert d.metrics.etcd.up._value.get() == 0
    assert d.metrics.etcd.outages._value.get() == 1
    for _ in range(4):
        out = tick()
    assert d.status()["etcd_outage_seconds"] == pytest.approx(1.0, abs=0.3)
    store.set_refusing(False)
    for _ in range(4):
        out = tick()
    assert d.health.up and d.status()["etcd_outage_kind"] is None
    assert d.metrics.etcd.up._value.get() == 1
    assert out["n1"] == "no action: I am n1, 1 nodes alive" or "1 node" in out["n1"], out


def test_watches_are_recreated_after_etcd_was_away_not_after_it_refused(world):
    """A refusal outage (etcd answering, its users changing: every node at a big job's start)
    leaves the watch streams as they were; re-creating every watch on every node then would be
    a storm at scale. An outage where etcd was unreachable re-creates them (a stream may be
    silently stuck)."""
    clock, store, start, tick, daemons = world
    d = start("n1", outage_grace=30.0)
    rewatched = []
    d.coord.rewatch = lambda: rewatched.append(clock.monotonic())
    tick()
    store.set_refusing(True)
    tick()
    store.set_refusing(False)
    tick()
    assert d.health.up and rewatched == []
    store.set_available(False)
    tick()
    store.set_available(True)
    tick()
    assert d.health.up and len(rewatched) == 1


def test_long_outage_fences_after_grace(world):
    clock, store, start, tick, daemons = world
    d = start("n1", outage_grace=5.0)
    fenced = []
    d.fence.hooks.append(fenced.append)
    store.set_available(False)
    for _ in range(int(4.5 / 0.25)):
        out = tick()
    assert not fenced and "keeping workers running" in out["n1"]
    for _ in range(4):
        out = tick()
    assert fenced == ["etcd unreachable for more than 5 s"]
    assert "fenced" in out["n1"]
    store.set_available(True)
    for _ in range(4 * TTL):
        out = tick()
    assert d.state.value == "up" and d.registered_lease is not None


def test_refusals_past_the_grace_fence_with_their_own_reason(world):
    """An operator reading the fence's reason learns what to fix: etcd refusing every request
    (its users changing), not a network to repair."""
    clock, store, start, tick, daemons = world
    d = start("n1", outage_grace=1.0)
    fenced = []
    d.fence.hooks.append(fenced.append)
    tick()
    store.set_refusing(True)
    for _ in range(4 * 2):
        tick()
    assert fenced == ["etcd refuses our requests for more than 1 s"]
    assert d.status()["fenced_for"] == fenced[0]


def test_declared_dead_node_fences_before_rejoining(world):
    clock, store, start, tick, daemons = world
    start("n1"), start("n2")
    tick()
    fenced = []
    daemons["n2"].fence.hooks.append(fenced.append)
    for _ in range(int(TTL / 0.25) + 2):  # n2 frozen: no keep-alive, no cycle
        tick(alive={"n1"})
    assert [e.node for e in events(store, "failed")] == ["n2"]
    out = tick()  # n2 thaws
    assert fenced and "declared dead" in fenced[0]
    assert [e.node for e in events(store, "fenced")] == ["n2"]
    for _ in range(4):
        out = tick()
    assert daemons["n2"].state.value == "up"
    assert daemons["n1"].membership.alive() == ["n1", "n2"]


def test_same_node_id_twice_is_refused(world):
    clock, store, start, tick, daemons = world
    first = start("n1")

    class KeepFirstAlive(FakeClock):
        """While the newcomer waits for the id, the first holder keeps its lease."""

        def sleep(self, seconds):
            clock.advance(seconds)
            first.keeper.step()

        def monotonic(self):
            return clock.monotonic()

        def wall(self):
            return clock.wall()

    s = Settings(node_id="n1", etcd="mem:1", lease_ttl=TTL)
    other = Daemon(s, MemoryCoordinator(store), clock=KeepFirstAlive())
    other.registration.incarnation = "other"
    from elasticd.daemon.registration import Registration

    orig = Registration._is_dead_local
    Registration._is_dead_local = staticmethod(lambda rec: False)
    try:
        with pytest.raises(NodeIdInUse, match="give this node another --node-id"):
            other.join(keep_alive_thread=False)
    finally:
        Registration._is_dead_local = orig
        other.close()


def _submit(store, name="job"):
    """A job spec and control as elasticctl submit writes them."""
    from elasticd.cluster.jobspec import JobControl, JobSpec

    coord, keys = MemoryCoordinator(store), Keyspace("/elasticd")
    spec = JobSpec(name=name, nnodes_min=2, nnodes_max=3, nproc_per_node=1,
                   script="/bin/true", args=[], script_sha256="0" * 64, user="nobody",
                   cwd="/tmp")
    coord.put(keys.job_keys(name).spec, spec.encode())
    coord.put(keys.job_keys(name).control, JobControl("running", 1.0, "test").encode())


def test_etcd_wiped_every_daemon_recovers_without_failures(world):
    clock, store, start, tick, daemons = world
    for n in ("n1", "n2", "n3"):
        start(n)
    _submit(store)
    _submit(store, "stopped-job")
    from elasticd.cluster.jobspec import JobControl

    MemoryCoordinator(store).put(Keyspace("/elasticd").job_keys("stopped-job").control,
                                 JobControl("stopped", 1.0, "test").encode())
    for d in daemons.values():
        d.jobs._start = lambda job: None  # no agent here: only what the daemons believe
    for _ in range(4):
        tick()
    assert all(set(d.jobs.records.specs) == {"job", "stopped-job"} for d in daemons.values())

    store.wipe()  # etcd back on an empty data dir: keys, leases and watch positions gone
    out = {}
    for _ in range(4 * TTL * 4):  # two TTLs and more
        out = tick()
    assert not events(store, "failed") and not events(store, "fenced"), events(store)
    lost = events(store, "etcd_data_lost")
    assert len(lost) == 1, lost
    assert all(d.metrics.etcd.data_losses._value.get() == 1 for d in daemons.values())
    assert all(d.membership.alive() == ["n1", "n2", "n3"] for d in daemons.values())
    assert all(d.registered_lease is not None for d in daemons.values())
    # The specs are back, and the stopped job stays stopped.
    for d in daemons.values():
        assert set(d.jobs.records.specs) == {"job", "stopped-job"}, d.jobs.records.specs
        assert d.jobs.records.controls["stopped-job"].desired == "stopped"
        assert d.jobs.wanted() == "job"
    assert out["n1"] == "no action: I am n1, 3 nodes alive", out
    # A watch keeps working after the recovery: a new node is seen by everyone.
    start("n4")
    out = tick()
    assert all("n4" in d.membership.alive() for d in daemons.values())


def test_a_job_stopped_before_the_wipe_is_not_brought_back(world):
    clock, store, start, tick, daemons = world
    start("n1"), start("n2")
    _submit(store)
    for d in daemons.values():
        d.jobs._start = lambda job: None
    tick()
    # removed on purpose
    MemoryCoordinator(store).delete(Keyspace("/elasticd").job_keys("job").spec)
    tick()
    assert all(not d.jobs.records.specs for d in daemons.values())
    store.wipe()
    for _ in range(4 * TTL * 4):
        tick()
    assert all(not d.jobs.records.specs for d in daemons.values())
    assert MemoryCoordinator(store).get(Keyspace("/elasticd").job_keys("job").spec) is None


def test_the_lease_is_the_heartbeat_and_the_watch_is_trusted_until_it_says_otherwise(world):
    clock, store, start, tick, daemons = world
    start("n1"), start("n2")
    for _ in range(8):  # settles: the "joined" sentence gives way to "no action", published
        tick()
    n1 = daemons["n1"]
    peek = MemoryCoordinator(store)
    key = Keyspace("/elasticd").node("n1")
    written = peek.get(key).mod_revision
    listings = []
    real_get_prefix = n1.coord.get_prefix

    def counting_get_prefix(prefix):
        if prefix == n1.peers.keys.nodes:
            listings.append(prefix)
        return real_get_prefix(prefix)

    n1.coord.get_prefix = counting_get_prefix
    for _ in range(int(120 / 0.25)):  # two minutes, sixty TTLs
        out = tick()
    assert out["n1"] == "no action: I am n1, 2 nodes alive"
    assert peek.get(key).mod_revision == written, "the node record was rewritten on a timer"
    assert listings == [], "the node records were re-listed with nothing to distrust"
    # A watch error (what a resumed watch after a data loss may be): re-list at once.
    n1.peers._feed.put(CoordinationError("watch broke"))
    tick()
    assert listings == [n1.peers.keys.nodes]
    # Our own record deleted while our lease lives: written again at once, same lease (as the
    # timed rewrite did; the peers count the deletion as a failure either way).
    lease = peek.get(key).lease
    peek.delete(key)
    tick(), tick()  # the deletion seen, the record written; then its put seen
    assert peek.get(key) is not None and peek.get(key).lease == lease
    assert n1.membership.alive() == ["n1", "n2"]


def test_a_record_that_cannot_be_written_fails_the_cycle_instead_of_holding_the_loop(world):
    # A create that keeps failing on a key that reads as absent: the registration retried
    # without pause or deadline, and the main loop never got back to see a SIGTERM.
    clock, store, start, tick, daemons = world
    d = start("n1")

    class NeverCreates(MemoryCoordinator):
        attempts = 0

        def create(self, key, value, lease=None):
            NeverCreates.attempts += 1
            if NeverCreates.attempts > 10_000:
                raise AssertionError("registration spun 10,000 times without giving up")
            return False

        def get(self, key):
            return None

    d.coord = d.registration.coord = NeverCreates(store)
    d.registration.lease = None
    start_at = clock.monotonic()
    sentence = d.cycle()
    assert "could not write this node's record" in sentence, sentence
    assert NeverCreates.attempts < 200
    assert clock.monotonic() - start_at <= 2 * TTL + 1 + 0.5


def test_a_failure_is_told_to_the_rendezvous_of_the_job_this_node_runs(world, monkeypatch):
    """Issue 31: the survivors write the failed lease's mark into their job's rendezvous and
    delete the join records naming it (elasticd/rendezvous/failures.py); a record naming
    another node, or another lease of the failed one, stays."""
    from elasticd.agent.manager import JobManager
    from elasticd.rendezvous.failures import mark_key
    from elasticd.rendezvous.records import NodeRecord

    clock, store, start, tick, daemons = world
    for n in ("n1", "n2", "n3"):
        start(n)
    tick()
    coord, keys = MemoryCoordinator(store), Keyspace("/elasticd")
    native = keys.rendezvous("j").prefix + b"native/"
    lease2 = daemons["n2"].registered_lease
    records = {b"a1": NodeRecord("a1", 0, daemon="n1", daemon_lease=daemons["n1"].registered_lease),
               b"a2": NodeRecord("a2", 0, daemon="n2", daemon_lease=lease2),
               b"old2": NodeRecord("old2", 0, daemon="n2", daemon_lease=lease2 + 1)}
    for key, rec in records.items():
        coord.put(native + b"nodes/" + key, rec.encode())
    monkeypatch.setattr(JobManager, "job", property(lambda self: "j"))
    monkeypatch.setattr(JobManager, "on_peer_failed", lambda self, node: None)
    for _ in range(int(TTL / 0.25) + 2):  # n2 stops refreshing its lease
        tick(alive={"n1", "n3"})
    assert [e.node for e in events(store, "failed")] == ["n2"]
    assert coord.get(mark_key(native, "n2", lease2)) is not None
    left = {kv.key.rsplit(b"/", 1)[-1] for kv in coord.get_prefix(native + b"nodes/")[0]}
    assert left == {b"a1", b"old2"}
