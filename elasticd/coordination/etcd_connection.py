"""The one client an :class:`~elasticd.coordination.etcd.EtcdCoordinator` talks to etcd
through: failover, typed errors, repeats of refused requests, the lease keep-alive stream.

Every call of the coordinator and of its watches (:mod:`elasticd.coordination.etcd_watch`) goes
through :meth:`EtcdConnection.call`. Traps of ``pyetcd`` avoided here (docs/facts.md):

* The plain client's failed endpoint, refused for 300 s after one error: we always build a
  ``MultiEndpointEtcd3Client`` with ``failover=True`` and ``time_retry`` of half a second, and
  retry a call once per endpoint before reporting :class:`Unavailable`.
* gRPC errors surface as the library's exceptions, or as raw ``grpc.RpcError`` for codes it
  does not map; both are turned into this package's typed errors here and nowhere else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import elasticd.coordination.grpc_fork  # noqa: F401  (before grpc: see it)
import grpc
import pyetcd
from pyetcd import exceptions as etcd_exc

from elasticd.clock import Clock
from elasticd.coordination.api import (
    AuthError,
    Compacted,
    CoordinationError,
    LeaseLost,
    Refused,
    Unavailable,
)

if TYPE_CHECKING:
    from elasticd.coordination.etcd import EtcdSettings

T = TypeVar("T")

# gRPC keepalive pings find a dead TCP connection (a partitioned or frozen server) for watch
# streams that would otherwise wait forever. etcd rejects pings more often than every 5 s
# (--grpc-keepalive-min-time), so stay above that, and it rejects pings on a connection with no
# open call at all (its enforcement policy has PermitWithoutStream false): after two such pings
# it sends GOAWAY "too_many_pings" and drops the connection, failing whatever call was starting
# on it (seen in a torchrun agent, whose client holds no watch). So ping only during calls.
#
# gRPC backs off reconnects exponentially up to 120 s by default, so a daemon would find a
# restarted etcd only minutes later; cap the backoff at one second.
_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 3_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]

_UNAVAILABLE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}
# While etcd elects a leader it answers some requests with code UNKNOWN and the text of a
# server-side timeout ("context deadline exceeded", seen on a lease keep-alive after kill -9 of
# the leader) rather than UNAVAILABLE: retry those like an unreachable etcd.
_TRANSIENT_MESSAGES = ("context deadline exceeded", "context canceled", "leader changed",
                       "no leader", "request timed out", "server stopped")
_AUTH_CODES = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
# etcd answers some auth failures with INVALID_ARGUMENT (a wrong password; no user at all when
# auth is enabled).
_AUTH_MESSAGES = ("authentication failed", "user name is empty", "invalid auth token")
# etcd refuses, unapplied, a request whose token predates a user or role change that committed
# between the request's arrival and its apply (any daemon creating its agents' users causes
# one). etcd's own client repeats the request; so do we, for a while
# (EtcdSettings.refusal_patience), since a busy auth store can move again before the repeat
# lands.
_STALE_TOKEN = "revision of auth store is old"


class StaleToken(Refused):
    """etcd refused a request, unapplied, because its auth store changed under the token."""
class EtcdConnection:
    """The client of one etcd cluster, built at the first call and again after a failure."""

    def __init__(self, settings: EtcdSettings, clock: Clock) -> None:
        self.settings = settings
        self.clock = clock
        self._lock = threading.Lock()
        self._client: pyetcd.MultiEndpointEtcd3Client | None = None
        self._keepalive: _KeepAliveStream | None = None
        self._closed = False

    def bound_refusals(self, seconds: float) -> None:
        """From now on, repeats a request etcd refuses as older than its auth store for at
        most ``seconds`` (``settings.refusal_patience``), then raises :class:`Refused`.

        The daemon calls this once it has joined: its main loop makes its etcd calls on its
        own thread, and 10 s of repeats held the loop (and /healthz, which allows
        2 x etcd_timeout + 1 s) while nothing said etcd was refusing it. A :class:`Refused` is
        an outage to the loop: shown in /status and the metrics, counted by the outage grace,
        tried again next cycle. Before the join a failure is fatal, so the start waits longer.
        """
        with self._lock:
            self.settings = dataclasses.replace(self.settings, refusal_patience=seconds)

    def _build_client(self) -> pyetcd.MultiEndpointEtcd3Client:
        s = self.settings
        creds = None
        if s.secure:
            creds = pyetcd.MultiEndpointEtcd3Client.get_secure_creds(s.ca_cert, s.key, s.cert)
        endpoints = [
            pyetcd.Endpoint(h, p, secure=s.secure, creds=creds, time_retry=0.5,
                            opts=_CHANNEL_OPTIONS)
            for h, p in s.endpoints
        ]
        try:
            client = pyetcd.MultiEndpointEtcd3Client(
                endpoints, timeout=s.timeout, user=s.user, password=s.password, failover=True
            )
        except Exception as exc:  # authentication happens in the constructor
            for ep in endpoints:
                ep.close()
            raise self.translate(exc) from exc
        if not s.secure:
            # gRPC refuses call credentials on a plaintext channel ("insufficient security
            # level"); the auth token also travels as request metadata, which is enough.
            client.call_credentials = None
        return client

    def _get_client(self) -> pyetcd.MultiEndpointEtcd3Client:
        with self._lock:
            if self._closed:
                raise CoordinationError("coordinator is closed")
            if self._client is None:
                self._client = self._build_client()
            return self._client

    def _reset_client(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            # Closing a broken channel may itself fail; nothing to save.
            with contextlib.suppress(Exception):
                client.close()

    def translate(self, exc: BaseException) -> CoordinationError:
        where = self.settings.describe()
        if isinstance(exc, CoordinationError):
            return exc
        if isinstance(exc, (etcd_exc.ConnectionFailedError, etcd_exc.NoServerAvailableError)):
            return Unavailable(f"etcd at {where} is unreachable")
        if isinstance(exc, (etcd_exc.ConnectionTimeoutError, etcd_exc.WatchTimedOut)):
            return Unavailable(f"etcd at {where} did not answer within {self.settings.timeout}s")
        if isinstance(exc, etcd_exc.RevisionCompactedError):
            return Compacted(exc.compacted_revision)
        if isinstance(exc, grpc.RpcError):
            code = exc.code() if hasattr(exc, "code") else None
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            if code in _UNAVAILABLE_CODES or (
                    code == grpc.StatusCode.UNKNOWN
                    and any(m in (detail or "") for m in _TRANSIENT_MESSAGES)):
                return Unavailable(f"etcd at {where} is unreachable ({detail})")
            if _STALE_TOKEN in (detail or ""):
                return StaleToken(f"etcd at {where}: {detail}")
            if code in _AUTH_CODES or any(m in (detail or "") for m in _AUTH_MESSAGES):
                return AuthError(
                    f"etcd at {where} refused our credentials ({detail}); check --etcd-user/"
                    "--etcd-password or the TLS client certificate (after an etcd data loss "
                    "its users and roles are gone too: create them again, see "
                    "docs/operations.md 'etcd data loss')"
                )
            if code == grpc.StatusCode.NOT_FOUND and "lease" in (detail or ""):
                return LeaseLost(detail)
            return CoordinationError(f"etcd error {code}: {detail}")
        if isinstance(exc, etcd_exc.Etcd3Exception):
            return CoordinationError(f"etcd error: {exc!r}")
        if isinstance(exc, ValueError) and "failed node" in str(exc):
            return Unavailable(f"etcd at {where} is unreachable")
        return CoordinationError(f"unexpected etcd client error: {exc!r}")

    def call(self, fn: Callable[[pyetcd.MultiEndpointEtcd3Client], T]) -> T:
        """Runs ``fn`` with failover: one try per endpoint, and one re-authentication.

        An exception of torch's passes through unchanged: torch's agent turns SIGTERM into a
        ``SignalException`` raised from its signal handler wherever the thread is, often inside
        an etcd call here; reported as an etcd error, the agent took it for a rendezvous failure
        and closed the rendezvous for every node (CI: a drained node's agent ended the whole job
        this way). Anything the client itself raises, known or not, is a CoordinationError.
        """
        attempts = len(self.settings.endpoints) + 1
        last: CoordinationError | None = None
        stale_since = 0.0
        while attempts > 0:
            attempts -= 1
            client = self._get_client()
            try:
                return fn(client)
            except Exception as exc:
                if (type(exc).__module__ or "").partition(".")[0] == "torch":
                    raise
                err = self.translate(exc)
                if isinstance(err, StaleToken):
                    stale_since = stale_since or self.clock.monotonic()
                    if self._repeat_stale(client, stale_since):
                        attempts += 1
                        continue
                    raise StaleToken(
                        f"{err}; refused for {self.clock.monotonic() - stale_since:.1f} s "
                        "while etcd's users or roles kept changing") from exc
                if isinstance(err, AuthError) and self.settings.user and last is None:
                    # Simple auth tokens expire (5 min by default): log in again once.
                    self._reset_client()
                    last = err
                    continue
                if not isinstance(err, Unavailable):
                    raise err from exc
                last = err
        assert last is not None
        raise last

    def _repeat_stale(self, client: pyetcd.MultiEndpointEtcd3Client, since: float) -> bool:
        """Whether to repeat a request etcd refused as older than its auth store (after the
        pause this takes), for up to ``settings.refusal_patience`` seconds.

        A simple token holds no revision (etcd stamps its current one on a request as it
        arrives), so the same token is repeated: it fails again only while user changes keep
        landing between a request's arrival and its apply. A JWT holds its own revision and
        needs a new log-in. A simple token does not log in again: etcd repeats a log-in, with a
        bcrypt check, for as long as its auth store moves. Measured on etcd 3.4 with a user
        added and deleted every 0.1 s: writes were refused for over 10 s in a row and log-ins
        starved past 10 s; every 0.2 s, each write got through within two repeats.
        """
        waited = self.clock.monotonic() - since
        left = self.settings.refusal_patience - waited
        if left <= 0:
            return False
        token = dict(client.metadata or ()).get("token", "")
        if token.count(".") >= 2:  # header.payload.signature
            self._reset_client()
        # Never sleep past the patience: the caller's bound is what holds its thread.
        self.clock.sleep(min(0.05 * 2 ** int(waited / 0.1), 0.5, left))
        return True

    def refresh_lease(self, lease: int) -> int:
        """Refreshes ``lease`` on this client's one long-lived LeaseKeepAlive stream (opened
        at the first refresh, re-opened after it broke): a stream per refresh, what the client
        library does, costs ~1 ms of client CPU and ~0.3 ms of etcd CPU each, against ~0.1 ms
        on a stream kept open. Returns the TTL etcd granted (0 or less: the lease is gone)."""
        return self.call(lambda c: self._keepalive_stream(c).refresh(lease))

    def _keepalive_stream(self, client: pyetcd.MultiEndpointEtcd3Client) -> _KeepAliveStream:
        with self._lock:
            stream = self._keepalive
            if stream is None or stream.client is not client or stream.broken:
                if stream is not None:
                    stream.close()
                stream = self._keepalive = _KeepAliveStream(client, self.settings.timeout)
            return stream

    def auth_call(self, method: str, request: Any) -> Any:
        """Calls one of etcd's Auth RPCs (``UserAdd``, ``RoleGrantPermission``, ...) with this
        client's credentials (managing users needs etcd's root role)."""
        return self.call(lambda c: getattr(c.authstub, method)(
            request, c.timeout, credentials=c.call_credentials, metadata=c.metadata))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
            stream, self._keepalive = self._keepalive, None
        if stream is not None:
            stream.close()
        if client is not None:
            client.close()


class _KeepAliveStream:
    """One long-lived LeaseKeepAlive stream for every lease of a client.

    :meth:`refresh` queues a request and waits for etcd's answer for that lease (etcd answers
    each request on the stream, in order per lease). A reader thread takes the answers; when
    the stream ends or fails, every waiter gets the error and the owner opens a new stream at
    the next refresh.
    """

    def __init__(self, client: pyetcd.MultiEndpointEtcd3Client, timeout: float) -> None:
        self.client = client
        self._timeout = timeout
        self._lock = threading.Lock()
        self._waiting: dict[int, list[list[Any]]] = {}  # lease -> [[event, ttl or error]]
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.broken = False
        self._call = client.leasestub.LeaseKeepAlive(
            iter(self._requests.get, None), credentials=client.call_credentials,
            metadata=client.metadata)
        self._reader = threading.Thread(target=self._read, name="lease-keepalive",
                                         daemon=True)
        self._reader.start()

    def refresh(self, lease: int) -> int:
        """Refreshes once; returns the TTL etcd granted (0 or less: the lease is gone).

        Raises:
            Unavailable: no answer within the client's timeout (the stream is then dropped).
            grpc.RpcError: the stream failed (translated by the caller).
        """
        slot: list[Any] = [threading.Event(), None]
        with self._lock:
            if self.broken:
                raise Unavailable("the keep-alive stream broke")
            self._waiting.setdefault(lease, []).append(slot)
        self._requests.put(pyetcd.etcdrpc.LeaseKeepAliveRequest(ID=lease))
        if not slot[0].wait(self._timeout):
            self.close()
            raise Unavailable(f"no keep-alive answer for lease {lease:x} within "
                              f"{self._timeout}s")
        if isinstance(slot[1], BaseException):
            raise slot[1]
        return int(slot[1])

    def _read(self) -> None:
        error: BaseException = Unavailable("the keep-alive stream ended")
        try:
            for resp in self._call:
                with self._lock:
                    waiters = self._waiting.get(resp.ID)
                    slot = waiters.pop(0) if waiters else None
                    if waiters == []:
                        del self._waiting[resp.ID]
                if slot is not None:
                    slot[1] = resp.TTL
                    slot[0].set()
        except Exception as exc:  # noqa: BLE001 - handed to every waiter, translated there
            error = exc
        self._fail(error)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self.broken = True
            waiting, self._waiting = self._waiting, {}
        for slots in waiting.values():
            for slot in slots:
                slot[1] = error
                slot[0].set()

    def close(self) -> None:
        with self._lock:
            self.broken = True
        self._requests.put(None)
        with contextlib.suppress(Exception):
            self._call.cancel()
