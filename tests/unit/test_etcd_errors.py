"""How the etcd adapter classifies client errors: what is retried as an unreachable etcd."""

from __future__ import annotations

import grpc
import pytest

from elasticd.config import Settings
from elasticd.coordination.api import (
    AuthError, CoordinationError, LeaseLost, Refused, Unavailable)
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings
from elasticd.testing.clock import FakeClock


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.fixture
def coordinator():
    return EtcdCoordinator(EtcdSettings(endpoints=(("127.0.0.1", 1),)))


@pytest.mark.parametrize("code, details, kind", [
    (grpc.StatusCode.UNAVAILABLE, "failed to connect", Unavailable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", Unavailable),
    # What etcd answered during a leader election after kill -9 of its leader.
    (grpc.StatusCode.UNKNOWN, "context deadline exceeded", Unavailable),
    (grpc.StatusCode.UNKNOWN, "etcdserver: leader changed", Unavailable),
    (grpc.StatusCode.UNKNOWN, "etcdserver: request timed out", Unavailable),
    (grpc.StatusCode.UNKNOWN, "something else entirely", CoordinationError),
    (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: authentication failed", AuthError),
    (grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found", LeaseLost),
])
def test_client_errors_are_classified(coordinator, code, details, kind):
    err = coordinator.connection.translate(FakeRpcError(code, details))
    assert type(err) is kind, err
    assert details in str(err)


STALE = "etcdserver: revision of auth store is old"


class TokenClient:
    """Stands in for pyetcd's client: what ``EtcdConnection.call`` reads of it is its token."""

    def __init__(self, token: str) -> None:
        self.metadata = (("token", token),)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("token, logins", [("abcdefghijklmnop.42", 1), ("eyJh.eyJw.c2ln", 3)])
def test_a_stale_token_is_repeated_and_a_jwt_logs_in_again(token, logins):
    """A simple token is repeated as it is (etcd stamps each request's revision itself); a JWT
    carries its own revision, so each repeat logs in again."""
    clock = FakeClock()
    c = EtcdCoordinator(EtcdSettings(endpoints=(("127.0.0.1", 1),), user="u", password="p"),
                        clock=clock)
    built = []
    c.connection._build_client = lambda: built.append(1) or TokenClient(token)
    refusals = iter([STALE, STALE])

    def fn(client):
        detail = next(refusals, None)
        if detail:
            raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, detail)
        return "done"

    assert c.connection.call(fn) == "done"
    assert len(built) == logins
    assert 0 < clock.monotonic() - 1_000.0 < 1.0  # paused between repeats


def test_a_token_that_stays_stale_fails_after_ten_seconds():
    clock = FakeClock()
    c = EtcdCoordinator(EtcdSettings(endpoints=(("127.0.0.1", 1),), user="u", password="p"),
                        clock=clock)
    c.connection._build_client = lambda: TokenClient("abcdefghijklmnop.42")

    def fn(client):
        raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, STALE)

    with pytest.raises(Refused, match="auth store is old"):
        c.connection.call(fn)
    assert 10.0 <= clock.monotonic() - 1_000.0 < 11.0


def test_a_joined_daemon_repeats_a_refused_request_no_longer_than_one_request_may_take():
    """The daemon's main loop makes its etcd calls on its own thread: 10 s of repeats held it
    (and /healthz, which allows 2 x etcd_timeout + 1 s) while EtcdHealth, /status and the
    metrics said nothing. Once joined (Daemon.join bounds them, test_daemon_memory.py), past
    etcd_timeout the refusal is an Unavailable, which the loop counts as an outage of its own
    kind and retries next cycle."""
    clock = FakeClock()
    settings = Settings(node_id="n1", etcd="127.0.0.1:1", etcd_timeout=1.5,
                        etcd_user="u", etcd_password="p")
    c = EtcdCoordinator(settings.etcd_settings(), clock=clock)
    assert c.connection.settings.refusal_patience == 10.0  # the start: a failure there is fatal
    c.etcd().bound_refusals(settings.etcd_timeout)
    c.connection._build_client = lambda: TokenClient("abcdefghijklmnop.42")
    tries = []

    def fn(client):
        tries.append(clock.monotonic())
        raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, STALE)

    with pytest.raises(Unavailable, match="auth store is old") as caught:
        c.connection.call(fn)
    assert isinstance(caught.value, Refused)
    assert "refused for 1.5 s" in str(caught.value)
    assert clock.monotonic() - 1_000.0 == pytest.approx(1.5)
    assert len(tries) > 3  # repeated, with pauses, within the bound
