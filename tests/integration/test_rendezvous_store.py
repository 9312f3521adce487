"""Contract tests of the etcd-v3 rendezvous' store and its outage grace, on a real etcd and on
the fake.

The store contract is what torch's agent and workers ask of a ``torch.distributed.Store``
(TCPStore's semantics). It runs against a real etcd (``etcd`` marker) and against
:class:`MemoryCoordinator`, so the fake cannot drift. The outage tests pause a private etcd with
SIGSTOP.
"""

from __future__ import annotations

import datetime
import signal
import threading
import time

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.utils import store as store_util

from elasticd.testing.clock import FakeClock
from elasticd.coordination.api import AuthError, Unavailable
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.coordination.keys import Keyspace
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
from elasticd.rendezvous.grace import EtcdUnavailableError, OutageGrace
from elasticd.rendezvous.store import EtcdV3Store

RUN_ID = "job-1"


def connect(server, timeout: float = 1.0) -> EtcdCoordinator:
    # Not imported from conftest: whether tests/ is a package decides how that would import.
    return EtcdCoordinator(EtcdSettings(parse_endpoints(server.endpoints), timeout=timeout))


# -- store contract -----------------------------------------------------------------------


class StoreContract:
    """Subclasses provide the ``coordinator`` fixture."""

    @pytest.fixture
    def store_prefix(self, prefix):
        return Keyspace(prefix).rendezvous(RUN_ID).prefix + b"store/"

    @pytest.fixture
    def store(self, coordinator, store_prefix):
        return EtcdV3Store(coordinator, store_prefix, datetime.timedelta(seconds=5))

    def test_set_then_get_returns_bytes(self, store, coordinator, store_prefix):
        store.set("k", b"\x00\xffv")
        store.set("s", "text")
        assert store.get("k") == b"\x00\xffv"
        assert store.get("s") == b"text"
        assert coordinator.get(store_prefix + b"k").value == b"\x00\xffv"

    def test_get_waits_for_the_key(self, coordinator, store_prefix):
        reader = EtcdV3Store(coordinator, store_prefix, datetime.timedelta(seconds=10))
        writer = EtcdV3Store(coordinator, store_prefix)
        timer = threading.Timer(0.5, writer.set, args=("MASTER_ADDR", b"foo"))
        start = time.monotonic()
        timer.start()
        try:
            assert reader.get("MASTER_ADDR") == b"foo"
        finally:
            timer.cancel()
        assert 0.45 <= time.monotonic() - start < 5

    def test_get_times_out_with_dist_store_error(self, coordinator, store_prefix):
        store = EtcdV3Store(coordinator, store_prefix, datetime.timedelta(seconds=0.3))
        start = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="missing"):
            store.get("missing")
        assert 0.3 <= time.monotonic() - start < 2

    def test_wait_returns_when_keys_exist_and_times_out_otherwise(self, store):
        store.set("a", b"1")
        store.wait(["a"])
        start = time.monotonic()
        with pytest.raises(dist.DistStoreError, match=r"\['b'\]"):
            store.wait(["a", "b"], datetime.timedelta(seconds=0.2))
        assert 0.2 <= time.monotonic() - start < 2

    def test_check(self, store):
        assert store.check([]) is True
        store.set("a", b"1")
        assert store.check(["a"]) is True
        assert store.check(["a", "b"]) is False

    def test_add_counts_from_zero(self, store):
        assert store.add("n", 1) == 1
        assert store.add("n", 5) == 6
        assert store.add("n", -2) == 4
        assert store.get("n") == b"4"

    def test_add_refuses_a_non_integer(self, store):
        store.set("n", b"abc")
        with pytest.raises(dist.DistStoreError, match="not an integer"):
            store.add("n", 1)

    def test_concurrent_adds_are_not_lost(self, coordinator, store_prefix):
        stores = [EtcdV3Store(coordinator, store_prefix) for _ in range(4)]
        seen: list[int] = []
        lock = threading.Lock()

        def work(s):
            for _ in range(10):
                v = s.add("n", 1)
                with lock:
                    seen.append(v)

        threads = [threading.Thread(target=work, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(seen) == list(range(1, 41))
        # The idempotency markers are cleaned up.
        assert coordinator.get_prefix(store_prefix[:-1] + b"-adds/")[0] == []

    def test_concurrent_appends_are_not_lost(self, coordinator, store_prefix):
        stores = [EtcdV3Store(coordinator, store_prefix) for _ in range(4)]

        def work(s, letter):
            for _ in range(10):
                s.append("log", letter)

        threads = [threading.Thread(target=work, args=(s, c)) for s, c in zip(stores, "abcd")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        value = stores[0].get("log")
        assert sorted(value) == sorted(b"abcd" * 10)
        assert stores[0].has_extended_api()
        assert coordinator.get_prefix(store_prefix[:-1] + b"-adds/")[0] == []

    def test_compare_set_semantics_match_tcpstore(self, store):
        assert store.compare_set("k", b"x", b"y") == b"x"  # absent, expected given
        assert not store.check(["k"])
        assert store.compare_set("k", b"", b"first") == b"first"  # absent, expected empty
        assert store.compare_set("k", b"wrong", b"z") == b"first"  # mismatch
        assert store.compare_set("k", b"first", b"second") == b"second"  # match
        assert store.get("k") == b"second"

    def test_delete_key_and_num_keys(self, store):
        assert store.num_keys() == 0
        store.set("a", b"1")
        store.set("b", b"2")
        assert store.num_keys() == 2
        assert store.delete_key("a") is True
        assert store.delete_key("a") is False
        assert store.num_keys() == 1

    def test_through_torchs_prefix_store(self, store):
        # This is how the agents see it: dynamic_rendezvous wraps it per round.
        p = dist.PrefixStore("torch.rendezvous.job-1.0", store)
        p.set("MASTER_ADDR", b"127.0.0.1")
        assert p.get("MASTER_ADDR") == b"127.0.0.1"
        p.multi_set(["r0", "r1"], [b"a", b"b"])
        assert p.multi_get(["r0", "r1"]) == [b"a", b"b"]
        assert p.add("n", 2) == 2
        assert p.check(["n"]) and not p.check(["zz"])
        assert p.compare_set("c", "", "v") == b"v"
        p.wait(["r0"])
        with pytest.raises(dist.DistStoreError):
            p.wait(["zz"], datetime.timedelta(seconds=0.1))
        assert p.delete_key("r1") is True
        assert store.get("torch.rendezvous.job-1.0/r0") == b"a"

    def test_torch_barrier_and_synchronize_across_agents(self, coordinator, store_prefix):
        stores = [EtcdV3Store(coordinator, store_prefix) for _ in range(3)]
        out: dict[int, list[bytes]] = {}
        errors: list[BaseException] = []

        def agent(rank):
            try:
                out[rank] = store_util.synchronize(stores[rank], f"d{rank}".encode(), rank, 3,
                                                   "sync/", timeout=10)
                store_util.barrier(stores[rank], 3, "exit/", barrier_timeout=10)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=agent, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors
        assert all(out[r] == [b"d0", b"d1", b"d2"] for r in range(3))


class TestStoreOnMemory(StoreContract):
    @pytest.fixture
    def coordinator(self):
        return MemoryCoordinator()


@pytest.mark.etcd
class TestStoreOnEtcd(StoreContract):
    @pytest.fixture
    def coordinator(self, etcd_client):
        return etcd_client


# -- outage grace, on the fake with a fake clock ------------------------------------------


class HealingClock(FakeClock):
    """A fake clock that brings the memory store back after ``heal_after`` seconds."""

    def __init__(self, store: MemoryStore, heal_after: float) -> None:
        super().__init__()
        self._store = store
        self._heal_at = self.monotonic() + heal_after

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        if self.monotonic() >= self._heal_at:
            self._store.set_available(True)


def _down_memory(heal_after: float) -> tuple[MemoryCoordinator, HealingClock]:
    server = MemoryStore()
    coordinator = MemoryCoordinator(server)
    clock = HealingClock(server, heal_after)
    server.set_available(False)
    return coordinator, clock


def test_a_write_rides_out_an_outage_shorter_than_the_grace_period():
    coordinator, clock = _down_memory(heal_after=20)
    store = EtcdV3Store(coordinator, b"/e/jobs/j/rdzv/store/", grace=OutageGrace(30, clock=clock))
    start = clock.monotonic()
    store.set("k", b"x")
    assert 20 <= clock.monotonic() - start < 22
    assert store.get("k") == b"x"


def test_a_write_fails_after_the_grace_period():
    coordinator, clock = _down_memory(heal_after=1e9)
    store = EtcdV3Store(coordinator, b"/e/jobs/j/rdzv/store/", grace=OutageGrace(30, clock=clock))
    start = clock.monotonic()
    with pytest.raises(RendezvousConnectionError, match="etcd_grace_period is 30s") as info:
        store.set("k", b"x")
    assert isinstance(info.value.__cause__, Unavailable)
    assert 30 <= clock.monotonic() - start < 31


def test_store_get_rides_out_an_outage():
    coordinator, clock = _down_memory(heal_after=10)
    store = EtcdV3Store(coordinator, b"/e/jobs/j/rdzv/store/", datetime.timedelta(seconds=60),
                        grace=OutageGrace(30, clock=clock))
    start = clock.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.get("k")  # etcd comes back after 10 s, the key never appears: store timeout
    assert 60 <= clock.monotonic() - start < 61


def test_errors_that_waiting_cannot_fix_are_raised_at_once():
    clock = FakeClock()
    calls = []

    def refused():
        calls.append(1)
        raise AuthError("bad password")

    with pytest.raises(EtcdUnavailableError, match="refused our credentials"):
        OutageGrace(30, clock=clock).call(refused, "testing")
    assert len(calls) == 1


def test_grace_zero_means_no_retry():
    clock = FakeClock()
    calls = []

    def down():
        calls.append(1)
        raise Unavailable("down")

    with pytest.raises(EtcdUnavailableError):
        OutageGrace(0, clock=clock).call(down, "testing")
    assert len(calls) == 1


# -- outage grace, on a real etcd paused with SIGSTOP --------------------------------------


@pytest.mark.etcd
@pytest.mark.timeout(60)
def test_real_etcd_pause_is_ridden_out_then_fails_after_grace(private_etcd, prefix):
    member = private_etcd.members[0]
    coordinator = connect(private_etcd, timeout=0.5)
    try:
        store = EtcdV3Store(coordinator, Keyspace(prefix).rendezvous(RUN_ID).prefix + b"store/",
                            grace=OutageGrace(3.0, where=private_etcd.endpoints))
        store.set("k", b"before")

        # A 1.5 s pause: the call blocks through it and succeeds.
        member.signal(signal.SIGSTOP)
        resume = threading.Timer(1.5, member.signal, args=(signal.SIGCONT,))
        try:
            start = time.monotonic()
            resume.start()
            store.set("k", b"during")
            elapsed = time.monotonic() - start
        finally:
            resume.cancel()
            member.signal(signal.SIGCONT)
        assert 1.0 <= elapsed < 3.0
        assert store.get("k") == b"during"

        # A pause longer than the grace period: a clear error after about 3 s.
        member.signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(RendezvousConnectionError,
                               match="unreachable for .* etcd_grace_period is 3s"):
                store.set("k", b"late")
            elapsed = time.monotonic() - start
        finally:
            member.signal(signal.SIGCONT)
        # Up to one in-flight attempt (2 tries x 0.5 s request timeout) past the grace period.
        assert 3.0 <= elapsed < 5.0
        assert store.get("k") in (b"during", b"late")  # and all is well afterwards
    finally:
        coordinator.close()


@pytest.mark.etcd
@pytest.mark.timeout(60)
def test_real_etcd_pause_during_store_wait(private_etcd, prefix):
    member = private_etcd.members[0]
    coordinator = connect(private_etcd, timeout=0.5)
    other = connect(private_etcd, timeout=0.5)
    try:
        grace = OutageGrace(5.0, where=private_etcd.endpoints)
        store_prefix = Keyspace(prefix).rendezvous(RUN_ID).prefix + b"store/"
        reader = EtcdV3Store(coordinator, store_prefix, datetime.timedelta(seconds=20), grace)
        writer = EtcdV3Store(other, store_prefix, grace=grace)
        result: dict[str, object] = {}

        def read():
            try:
                result["value"] = reader.get("MASTER_PORT")
            except BaseException as exc:  # reported below
                result["error"] = exc

        t = threading.Thread(target=read)
        t.start()
        member.signal(signal.SIGSTOP)
        try:
            time.sleep(1.5)
        finally:
            member.signal(signal.SIGCONT)
        writer.set("MASTER_PORT", b"29500")
        t.join(15)
        assert result == {"value": b"29500"}
    finally:
        coordinator.close()
        other.close()


# -- writes whose outcome was unknown -----------------------------------------------------


class LosesReplyOnce(MemoryCoordinator):
    """etcd applies the next transaction but the reply is lost (the connection broke).

    A fault injected on top of the fake, not a stand-in for etcd: the state changes for real.
    """

    lose_next_reply = False

    def transaction(self, compares, ops):
        result = super().transaction(compares, ops)
        if self.lose_next_reply:
            self.lose_next_reply = False
            raise Unavailable("reply lost")
        return result


def test_add_whose_reply_was_lost_is_not_applied_twice():
    coordinator = LosesReplyOnce()
    store = EtcdV3Store(coordinator, b"/e/jobs/j/rdzv/store/",
                        grace=OutageGrace(5, clock=FakeClock()))
    assert store.add("n", 1) == 1
    coordinator.lose_next_reply = True
    assert store.add("n", 1) == 2
    assert store.get("n") == b"2"
    assert coordinator.get_prefix(b"/e/jobs/j/rdzv/store-adds/")[0] == []


@pytest.mark.etcd
def test_sigterm_inside_an_etcd_call_reaches_torchs_agent_as_a_signal(etcd, prefix):
    # torch's agent raises SignalException from its SIGTERM handler wherever the thread is. Seen
    # in CI: raised inside a rendezvous read, it came out as EtcdUnavailableError, the agent took it
    # for a rendezvous failure and closed the rendezvous, ending the job on every node.
    from torch.distributed.elastic.multiprocessing.api import SignalException

    coord = connect(etcd)
    try:
        store = EtcdV3Store(coord, Keyspace(prefix).rendezvous(RUN_ID).prefix + b"store/",
                            grace=OutageGrace(1.0))
        real = coord.connection._get_client()

        class Interrupted:
            def __getattr__(self, name):
                def call(*args, **kwargs):
                    raise SignalException("Process 1 got signal: 15", signal.SIGTERM)
                return call

        coord.connection._client = Interrupted()
        with pytest.raises(SignalException):
            store.check(["k"])
        coord.connection._client = real
        assert store.check(["k"]) is False  # an ordinary read works again
    finally:
        coord.close()
