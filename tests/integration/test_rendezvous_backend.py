"""Contract tests of the etcd-v3 rendezvous backend and store, on a real etcd and on the fake.

The backend contract mirrors torch's ``RendezvousBackendTestMixin`` (stale token, None token,
invalid token, corrupt state, get after set) plus the fencing property itself (two writers
holding the same token: exactly one wins). Each contract runs against a real etcd (``etcd``
marker) and against :class:`MemoryCoordinator`, so the fake cannot drift. The outage tests
pause a private etcd with SIGSTOP.
"""

from __future__ import annotations

import datetime
import signal
import threading
import time

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.utils import store as store_util

from elasticd.clock import FakeClock
from elasticd.coordination.api import AuthError, Unavailable
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.coordination.keys import Keyspace
from elasticd.coordination.memory import MemoryCoordinator, MemoryStore
from elasticd.coordination.rendezvous_backend import (
    EtcdV3RendezvousBackend,
    decode_state,
    encode_state,
)
from elasticd.coordination.rendezvous_grace import EtcdUnavailableError, OutageGrace
from elasticd.coordination.rendezvous_store import EtcdV3Store

RUN_ID = "job-1"


def connect(server, timeout: float = 1.0) -> EtcdCoordinator:
    # Not imported from conftest: whether tests/ is a package decides how that would import.
    return EtcdCoordinator(EtcdSettings(parse_endpoints(server.endpoints), timeout=timeout))


# -- backend contract ---------------------------------------------------------------------


class BackendContract:
    """Subclasses provide the ``coordinator`` fixture."""

    @pytest.fixture
    def keyspace(self, prefix):
        return Keyspace(prefix)

    @pytest.fixture
    def backend(self, coordinator, keyspace):
        return EtcdV3RendezvousBackend(coordinator, RUN_ID, keyspace, OutageGrace(1.0))

    def test_name_is_etcd_v3(self, backend):
        assert backend.name == "etcd-v3"

    def test_state_lives_under_the_jobs_rdzv_prefix(self, backend, coordinator, keyspace):
        backend.set_state(b"x")
        assert backend.key == keyspace.job_rdzv(RUN_ID) + b"state"
        assert coordinator.get(backend.key) is not None

    def test_get_state_returns_backend_state(self, backend):
        backend.set_state(b"x")
        result = backend.get_state()
        assert result is not None
        state, token = result
        assert state == b"x"
        assert token is not None

    def test_get_state_returns_none_if_backend_state_does_not_exist(self, backend):
        assert backend.get_state() is None

    def test_token_is_the_keys_mod_revision(self, backend, coordinator):
        _, token, _ = backend.set_state(b"x")
        assert token == coordinator.get(backend.key).mod_revision
        assert backend.get_state()[1] == token

    @pytest.mark.parametrize("raw", [
        b"non_base64",  # torch's own corruption case
        b"",
        encode_state(b"payload")[:-1],  # truncated: checksum mismatch
        encode_state(b"payload")[:5],  # shorter than the header
    ])
    def test_get_state_raises_error_if_backend_state_is_corrupt(self, backend, coordinator,
                                                                raw):
        coordinator.put(backend.key, raw)
        with pytest.raises(RendezvousStateError, match="corrupt"):
            backend.get_state()

    def test_get_state_refuses_an_unknown_format_version(self, backend, coordinator):
        raw = bytearray(encode_state(b"payload"))
        raw[4] = 99
        coordinator.put(backend.key, bytes(raw))
        with pytest.raises(RendezvousStateError, match="format 99"):
            backend.get_state()

    def test_set_state_raises_error_if_stored_state_is_corrupt(self, backend, coordinator):
        coordinator.put(backend.key, b"garbage")
        with pytest.raises(RendezvousStateError):
            backend.set_state(b"y", 1)

    def test_set_state_sets_backend_state_if_it_does_not_exist(self, backend):
        state, token, has_set = backend.set_state(b"x")
        assert state == b"x"
        assert token is not None
        assert has_set is True

    def test_set_state_sets_backend_state_if_token_is_current(self, backend):
        _, token1, has_set1 = backend.set_state(b"x")
        state2, token2, has_set2 = backend.set_state(b"y", token1)
        assert state2 == b"y"
        assert token1 != token2
        assert has_set1 and has_set2
        assert backend.get_state() == (b"y", token2)

    def test_set_state_returns_current_backend_state_if_token_is_old(self, backend):
        _, token1, _ = backend.set_state(b"x")
        state2, token2, _ = backend.set_state(b"y", token1)
        state3, token3, has_set = backend.set_state(b"z", token1)
        assert (state3, token3, has_set) == (state2, token2, False)
        assert backend.get_state() == (b"y", token2)

    def test_set_state_returns_current_backend_state_if_token_is_none(self, backend):
        state1, token1, _ = backend.set_state(b"x")
        state2, token2, has_set = backend.set_state(b"y")
        assert (state2, token2, has_set) == (state1, token1, False)

    @pytest.mark.parametrize("token", ["invalid", b"5", 1.5, True, object()])
    def test_set_state_returns_current_backend_state_if_token_is_invalid(self, backend, token):
        state1, token1, _ = backend.set_state(b"x")
        state2, token2, has_set = backend.set_state(b"y", token=token)
        assert (state2, token2, has_set) == (state1, token1, False)

    def test_set_state_with_a_token_returns_none_once_the_state_is_gone(self, backend,
                                                                        coordinator):
        _, token, _ = backend.set_state(b"x")
        coordinator.delete(backend.key)
        assert backend.set_state(b"y", token) is None

    def test_only_one_of_two_writers_with_the_same_token_wins(self, coordinator, keyspace):
        a = EtcdV3RendezvousBackend(coordinator, RUN_ID, keyspace)
        b = EtcdV3RendezvousBackend(coordinator, RUN_ID, keyspace)
        _, token, _ = a.set_state(b"base")
        results = {}
        barrier = threading.Barrier(2)

        def write(name, backend):
            barrier.wait()
            results[name] = backend.set_state(name.encode(), token)

        threads = [threading.Thread(target=write, args=(n, be)) for n, be in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        wins = [n for n, (_, _, ok) in results.items() if ok]
        assert len(wins) == 1
        loser = "b" if wins == ["a"] else "a"
        # The loser is handed the winner's state and token.
        assert results[loser][:2] == results[wins[0]][:2] == a.get_state()

    def test_state_filter_rewrites_what_torch_sees_not_what_is_stored(self, coordinator,
                                                                      keyspace):
        backend = EtcdV3RendezvousBackend(coordinator, RUN_ID, keyspace,
                                          state_filter=lambda s: s.upper())
        assert backend.set_state(b"x")[0] == b"X"
        assert backend.get_state()[0] == b"X"
        assert decode_state(coordinator.get(backend.key).value) == b"x"

    @pytest.mark.parametrize("run_id", ["", "a/b", "has space"])
    def test_bad_run_id_is_refused(self, coordinator, run_id):
        with pytest.raises(ValueError):
            EtcdV3RendezvousBackend(coordinator, run_id)


class TestBackendOnMemory(BackendContract):
    @pytest.fixture
    def coordinator(self):
        return MemoryCoordinator()


@pytest.mark.etcd
class TestBackendOnEtcd(BackendContract):
    @pytest.fixture
    def coordinator(self, etcd_client):
        return etcd_client


# -- store contract -----------------------------------------------------------------------


class StoreContract:
    """Subclasses provide the ``coordinator`` fixture."""

    @pytest.fixture
    def store_prefix(self, prefix):
        return Keyspace(prefix).job_rdzv(RUN_ID) + b"store/"

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


def test_backend_rides_out_an_outage_shorter_than_the_grace_period():
    coordinator, clock = _down_memory(heal_after=20)
    backend = EtcdV3RendezvousBackend(coordinator, RUN_ID, grace=OutageGrace(30, clock=clock))
    start = clock.monotonic()
    assert backend.set_state(b"x")[2] is True
    assert 20 <= clock.monotonic() - start < 22


def test_backend_fails_after_the_grace_period():
    coordinator, clock = _down_memory(heal_after=1e9)
    backend = EtcdV3RendezvousBackend(coordinator, RUN_ID, grace=OutageGrace(30, clock=clock))
    start = clock.monotonic()
    with pytest.raises(RendezvousConnectionError, match="etcd_grace_period is 30s") as info:
        backend.get_state()
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
        backend = EtcdV3RendezvousBackend(coordinator, RUN_ID, Keyspace(prefix),
                                          OutageGrace(3.0, where=private_etcd.endpoints))
        _, token, _ = backend.set_state(b"before")

        # A 1.5 s pause: the call blocks through it and succeeds.
        member.signal(signal.SIGSTOP)
        resume = threading.Timer(1.5, member.signal, args=(signal.SIGCONT,))
        try:
            start = time.monotonic()
            resume.start()
            state, token2, has_set = backend.set_state(b"during", token)
            elapsed = time.monotonic() - start
        finally:
            resume.cancel()
            member.signal(signal.SIGCONT)
        assert (state, has_set) == (b"during", True)
        assert 1.0 <= elapsed < 3.0
        assert backend.get_state() == (b"during", token2)

        # A pause longer than the grace period: a clear error after about 3 s.
        member.signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(RendezvousConnectionError,
                               match="unreachable for .* etcd_grace_period is 3s"):
                backend.get_state()
            elapsed = time.monotonic() - start
        finally:
            member.signal(signal.SIGCONT)
        # Up to one in-flight attempt (2 tries x 0.5 s request timeout) past the grace period.
        assert 3.0 <= elapsed < 5.0
        assert backend.get_state() == (b"during", token2)  # and all is well afterwards
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
        store_prefix = Keyspace(prefix).job_rdzv(RUN_ID) + b"store/"
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


def test_set_state_whose_reply_was_lost_reports_success():
    coordinator = LosesReplyOnce()
    backend = EtcdV3RendezvousBackend(coordinator, RUN_ID, grace=OutageGrace(5, clock=FakeClock()))
    _, token, _ = backend.set_state(b"x")
    coordinator.lose_next_reply = True
    state, token2, has_set = backend.set_state(b"y", token)
    assert (state, has_set) == (b"y", True)
    assert backend.get_state() == (b"y", token2)


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
    # in CI: raised inside a backend read, it came out as EtcdUnavailableError, the agent took it
    # for a rendezvous failure and closed the rendezvous, ending the job on every node.
    from torch.distributed.elastic.multiprocessing.api import SignalException

    coord = connect(etcd)
    try:
        backend = EtcdV3RendezvousBackend(coord, RUN_ID, Keyspace(prefix), OutageGrace(1.0))
        real = coord._get_client()

        class Interrupted:
            def __getattr__(self, name):
                def call(*args, **kwargs):
                    raise SignalException("Process 1 got signal: 15", signal.SIGTERM)
                return call

        coord._client = Interrupted()
        with pytest.raises(SignalException):
            backend.get_state()
        coord._client = real
        assert backend.get_state() is None  # an ordinary read works again
    finally:
        coord.close()
