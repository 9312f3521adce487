"""How the etcd adapter classifies client errors: what is retried as an unreachable etcd."""

from __future__ import annotations

import grpc
import pytest

from elasticd.coordination.api import AuthError, CoordinationError, LeaseLost, Unavailable
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings


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
    err = coordinator._translate(FakeRpcError(code, details))
    assert type(err) is kind, err
    assert details in str(err)
