"""The :class:`Coordinator` on a real etcd v3 cluster, through ``etcd-sdk-python`` (``pyetcd``).

Its parts: the connection every call goes through (failover, typed errors, repeats of refused
requests, the lease keep-alive stream: :mod:`elasticd.coordination.etcd_connection`) and the
watches (:mod:`elasticd.coordination.etcd_watch`): a watch stream that dies delivers the error
to its callback and is never re-created by the client library, so :class:`ResilientWatch`
re-creates it from the revision after the last event delivered, in its own thread (re-creating
from inside the client's callback thread would deadlock). A watch creation that timed out is
answered late and bound to the next watch created on the stream: it refuses any event outside
its own range (see that module).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Sequence

import elasticd.coordination.grpc_fork  # noqa: F401  (before grpc: see it)
import pyetcd

from elasticd.clock import Clock, SystemClock
from elasticd.coordination.api import (
    Compare,
    Coordinator,
    CoordinationError,
    KeyValue,
    LeaseLost,
    Op,
    Put,
    Watch,
    WatchCallback,
)
from elasticd.coordination.etcd_connection import EtcdConnection
from elasticd.coordination.etcd_watch import ResilientWatch, to_kv



@dataclasses.dataclass(frozen=True)
class EtcdSettings:
    """How to reach and authenticate to etcd.

    Attributes:
        endpoints: ``(host, port)`` pairs; calls fail over between them.
        timeout: seconds each request may take before the endpoint counts as unreachable.
        user, password: etcd auth (both or neither).
        ca_cert, cert, key: TLS files; ``ca_cert`` alone gives server-authenticated TLS,
            with ``cert`` and ``key`` the client authenticates too.
        refusal_patience: seconds a request etcd refuses as older than its auth store is
            repeated before it fails with :class:`Refused` (an :class:`Unavailable`). A
            one-shot client (elasticctl) waits long; a daemon that joined waits no longer
            than one request may take (:meth:`EtcdConnection.bound_refusals`).
    """

    endpoints: tuple[tuple[str, int], ...]
    timeout: float = 1.0
    user: str | None = None
    password: str | None = None
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    refusal_patience: float = 10.0

    @classmethod
    def of(cls, endpoints: tuple[tuple[str, int], ...], o: Any) -> "EtcdSettings":
        """From the daemon's settings or elasticctl's flags (``etcd_user``...; "": none)."""
        return cls(endpoints, o.etcd_timeout, o.etcd_user or None, o.etcd_password or None,
                   o.etcd_ca_cert or None, o.etcd_cert or None, o.etcd_key or None)

    @property
    def secure(self) -> bool:
        return self.ca_cert is not None

    def describe(self) -> str:
        scheme = "https" if self.secure else "http"
        return ",".join(f"{scheme}://{h}:{p}" for h, p in self.endpoints)


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """Parses ``HOST:PORT[,HOST:PORT...]`` (an ``http://`` prefix is allowed)."""
    out = []
    for part in text.split(","):
        part = part.strip().removeprefix("http://").removeprefix("https://")
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{part!r} is not HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    return tuple(out)  # never empty: "".split(",") is [""], which the loop refuses


class EtcdCoordinator(Coordinator):
    """A :class:`Coordinator` on an etcd v3 cluster."""

    def __init__(self, settings: EtcdSettings, clock: Clock | None = None) -> None:
        self.connection = EtcdConnection(settings, clock or SystemClock())
        self._lock = threading.Lock()
        self._watches: list[ResilientWatch] = []

    def etcd(self) -> EtcdConnection:
        return self.connection

    def auth_call(self, method: str, request: Any) -> Any:
        return self.connection.auth_call(method, request)

    # -- keys -----------------------------------------------------------------------------

    def get(self, key: bytes) -> KeyValue | None:
        resp = self.connection.call(lambda c: c.get_response(key))
        return to_kv(resp.kvs[0]) if resp.kvs else None

    def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        resp = self.connection.call(lambda c: c.get_prefix_response(prefix, sort_order="ascend"))
        return [to_kv(kv) for kv in resp.kvs], resp.header.revision

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        try:
            resp = self.connection.call(lambda c: c.put(key, value, lease=lease or None))
        except CoordinationError as exc:
            raise _lease_error(exc, lease) from exc
        return resp.header.revision

    def delete(self, key: bytes) -> bool:
        return self.connection.call(lambda c: c.delete(key))

    def delete_prefix(self, prefix: bytes) -> int:
        resp = self.connection.call(lambda c: c.delete_prefix(prefix))
        return resp.deleted

    def transaction(self, compares: Sequence[Compare], ops: Sequence[Op]) -> tuple[bool, int]:
        def run(c: pyetcd.MultiEndpointEtcd3Client) -> tuple[bool, int]:
            t = c.transactions
            cmp = [(_LeaseCompare(x.key) if x.target == "lease" else t.create(x.key)
                    if x.target == "create" else t.mod(x.key)) == x.mod_revision
                   for x in compares]
            success = [t.put(op.key, op.value, lease=op.lease or None) if isinstance(op, Put)
                       else t.delete(op.key) for op in ops]
            ok, responses = c.transaction(compare=cmp, success=success, failure=[])
            headers = [getattr(getattr(r, r.WhichOneof("response")), "header", None)
                       for r in responses]
            revision = max((h.revision for h in headers if h), default=0)
            if not revision:
                # A failed compare returns no responses: read the revision from a key of the
                # transaction's own (with etcd auth, our role may read nothing else).
                probe = compares[0].key if compares else ops[0].key if ops else b"\0"
                revision = c.get_response(probe).header.revision
            return ok, revision

        try:
            return self.connection.call(run)
        except CoordinationError as exc:
            leases = [op.lease for op in ops if isinstance(op, Put) and op.lease]
            raise _lease_error(exc, leases[0] if leases else 0) from exc

    # -- leases ---------------------------------------------------------------------------

    def grant_lease(self, ttl: int) -> int:
        return self.connection.call(lambda c: c.lease(ttl)).id

    def keep_alive(self, lease: int) -> float:
        ttl = self.connection.refresh_lease(lease)
        if ttl <= 0:
            raise LeaseLost(f"lease {lease:x} expired or was revoked")
        return float(ttl)

    def revoke_lease(self, lease: int) -> None:
        try:
            self.connection.call(lambda c: c.revoke_lease(lease))
        except CoordinationError as exc:
            if not isinstance(exc, LeaseLost) and "not found" not in str(exc):
                raise

    # -- watches --------------------------------------------------------------------------

    def watch_prefix(self, prefix: bytes, callback: WatchCallback, start_revision: int,
                     prev_kv: bool = False) -> Watch:
        return self._watch(ResilientWatch(self.connection, prefix, callback, start_revision,
                                          prev_kv))

    def watch_key(self, key: bytes, callback: WatchCallback, start_revision: int) -> Watch:
        return self._watch(ResilientWatch(self.connection, key, callback, start_revision,
                                          exact=True))

    def _watch(self, w: ResilientWatch) -> ResilientWatch:
        w.start()
        with self._lock:
            self._watches.append(w)
        return w

    def rewatch(self) -> None:
        with self._lock:
            watches = list(self._watches)
        for w in watches:
            w.restart()

    def reset_watches(self) -> None:
        # From the revision read now, not "whenever the stream is re-created": a caller that
        # re-lists right after this call then misses nothing in between.
        with self._lock:
            watches = list(self._watches)
        if not watches:
            return
        # Read the revision through a watched key: with etcd auth, our role may read nothing
        # outside the prefixes we watch.
        current = self.revision(watches[0].prefix)
        for w in watches:
            w.restart(from_revision=current + 1)

    def revision(self, probe: bytes = b"\0") -> int:
        return self.connection.call(lambda c: c.get_response(probe).header.revision)

    def close(self) -> None:
        with self._lock:
            watches, self._watches = self._watches, []
        for w in watches:
            w.cancel()
        self.connection.close()


class _LeaseCompare(pyetcd.transactions.BaseCompare):  # type: ignore[misc]
    """etcd's LEASE compare target (the client offers value, version, create and mod)."""

    def build_compare(self, compare: Any) -> None:
        compare.target = pyetcd.etcdrpc.Compare.LEASE
        compare.lease = int(self.value)


def _lease_error(exc: CoordinationError, lease: int) -> CoordinationError:
    if lease and "lease not found" in str(exc):
        return LeaseLost(f"lease {lease:x} not found")
    return exc
