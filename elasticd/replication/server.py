"""The replica server: accepts authenticated peer daemons and stores what they push.

A :class:`ReplicaServer` listens for peer daemons, authenticates each connection
(:mod:`elasticd.replication.auth`), and serves pushes and fetches on it, one thread per
connection. Pushed bytes go straight from the socket into the memory a
:class:`~elasticd.replication.api.Sink` hands out; a push is committed only after every DATA
frame passed its checksum and the byte count matched, and anything else (a dropped connection,
a corrupt frame, a timeout, a stop) aborts it.

Memory is bounded: per connection, one control buffer of ``max_control`` bytes; DATA lands in
the sink's memory, whose own budget applies; at most ``max_connections`` authenticated peers
and ``max_pending`` connections still in their handshake at once. A connection that sends
nothing for ``idle_timeout`` seconds is closed. Socket timeouts run on the real clock; the
injected clock only times transfers.

Connections that have not proved the secret yet never take an authenticated peer's place: they
are admitted by the rules of :mod:`elasticd.admission` (their own cap, the whole handshake
within ``handshake_timeout``, a flood from one address displacing only its own). Many addresses
each holding as few pending handshakes as a peer could still displace it; the total deadline
bounds each try.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import ssl
import threading
from typing import Any, Callable

from elasticd.admission import shut
from elasticd.clock import Clock, SystemClock
from elasticd.replication.api import (
    BAD_RANGE,
    NOT_COORDINATOR,
    NOT_FOUND,
    ConnectionLost,
    Refused,
    Sink,
    TransferTimeout,
)
from elasticd.replication.auth import check_secret, server_handshake
from elasticd.replication.seal import BlockTagger, BlockTags
from elasticd.replication.channel import (
    Channel,
    frame_chunk,
    receive_stream,
    send_spans,
    tune,
)
from elasticd.replication.connections import Connections, Listener
from elasticd.replication.messages import (
    Ack,
    CommitReply,
    CommitReport,
    Fetch,
    FetchReply,
    Nack,
    PutBegin,
)
from elasticd.replication.report import Reply, Report, decode_report, encode_reply
from elasticd.replication.wire import (
    DEFAULT_MAX_CONTROL,
    DEFAULT_MAX_FRAME,
    Limits,
    ProtocolError,
    ScopeViolation,
    UnexpectedFrame,
    UnsupportedVersion,
)

log = logging.getLogger(__name__)

#: The most snapshot bytes one DATA frame carries, as far as the peer's frame limit allows
#: (8 MiB by default: runs of seven 1 MiB blocks). Each frame costs each end Python work that
#: runs cold after the frame's socket call flushed the caches: 7 MiB runs cost the holder less
#: CPU than 4 MiB ones, 16 MiB no less and slower (bench/results/restore27/README.md).
DEFAULT_CHUNK = 8 << 20


def _request(msg: Any) -> str:
    """A request as a log line names it."""
    return (f"FETCH of job {msg.job!r}" if isinstance(msg, Fetch) else msg.TYPE.name)


@dataclasses.dataclass
class ServerStats:
    """Counters a metrics exporter reads (totals since start)."""

    pushes_committed: int = 0
    pushes_refused: int = 0
    pushes_aborted: int = 0
    protocol_errors: int = 0  # authenticated peers that broke the protocol (connection closed)
    bytes_received: int = 0


class ReplicaServer:
    """Accepts authenticated peers and stores what they push into ``sink`` (the limits:
    the module's docstring).

    Args:
        host, port: where to listen (port 0: any free port; see :attr:`address`).
        auth_failures: told (peer address, reason) of every rejected handshake, e.g. to bump
            a Prometheus counter; exceptions it raises are not caught.
    """

    def __init__(self, host: str, port: int, secret: bytes, node_id: str, sink: Sink,
                 max_frame: int = DEFAULT_MAX_FRAME, idle_timeout: float = 60.0, *,
                 handshake_timeout: float = 10.0, max_connections: int = 64,
                 max_pending: int = 32, max_control: int = DEFAULT_MAX_CONTROL,
                 ssl_context: ssl.SSLContext | None = None,
                 auth_failures: Callable[[str, str], None] | None = None,
                 chunk_size: int = DEFAULT_CHUNK, clock: Clock | None = None) -> None:
        if idle_timeout <= 0 or handshake_timeout <= 0:
            raise ValueError(f"timeouts must be > 0, got idle_timeout={idle_timeout}, "
                             f"handshake_timeout={handshake_timeout}")
        if max_connections < 1 or max_pending < 1 or chunk_size < 1:
            raise ValueError(f"max_connections, max_pending and chunk_size must be >= 1, got "
                             f"{max_connections}, {max_pending}, {chunk_size}")
        self._secret = check_secret(secret)
        self._blocks = BlockTagger(self._secret)
        self.node_id = node_id
        self.sink = sink
        self.limits = Limits(max_frame, max_control)
        self.idle_timeout = idle_timeout
        self.handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        self.max_pending = max_pending
        self.ssl_context = ssl_context
        self.auth_failures = auth_failures or (lambda peer, reason: None)
        self.chunk_size = chunk_size
        self.clock = clock or SystemClock()
        self.stats = ServerStats()
        self._connections = Connections(self.stats, max_connections, max_pending,
                                        handshake_timeout, self.clock)
        #: Where commit reports go (this node's coordination of their job); the node builder
        #: sets it. None: this server takes no reports (refused with ``not_coordinator``).
        self.on_report: Callable[[Report], Reply] | None = None
        self._listener = Listener(host, port, max_connections + max_pending, self._admit,
                                  self._expire_handshakes, node_id)
        self.address = self._listener.address  # port 0 resolved

    def snapshot_stats(self) -> ServerStats:
        """A consistent copy of the counters."""
        return self._connections.snapshot()

    def start(self) -> "ReplicaServer":
        self._listener.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stops accepting, closes every connection (aborting transfers) and joins threads."""
        if not self._connections.stop():
            return
        self._listener.stop(timeout)
        connections = self._connections.sockets()
        for sock in connections.values():
            shut(sock)
        for thread in connections:
            thread.join(timeout)

    def __enter__(self) -> "ReplicaServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- accepting -------------------------------------------------------------------------

    def _admit(self, sock: socket.socket, addr: tuple[str, int]) -> None:
        """Starts serving a new connection as pending, displacing one when the cap is full."""
        peer = f"{addr[0]}:{addr[1]}"
        thread = threading.Thread(target=self._serve, args=(sock, peer), daemon=True,
                                  name=f"replica-conn-{peer}")
        admitted, victim = self._connections.admit(thread, sock, addr[0])
        if not admitted:
            sock.close()
            return
        if victim is not None:
            log.debug("replica server %s: %d handshakes pending, displacing one for %s",
                        self.node_id, self.max_pending, peer)
            shut(victim)
        thread.start()

    def _expire_handshakes(self) -> float | None:
        """Ends handshakes past their deadline; returns seconds until the next one is due."""
        socks, wait = self._connections.expire()
        for sock in socks:
            shut(sock)  # its thread's receive returns, and it records the failure
        return wait

    # -- serving one connection ------------------------------------------------------------

    def _serve(self, sock: socket.socket, peer: str) -> None:
        me = threading.current_thread()
        channel = Channel(sock, self.limits)
        authenticated = False

        def admit() -> str | None:
            nonlocal authenticated
            refused = self._connections.authenticate(me)
            authenticated = refused is None
            return refused

        try:
            sock.settimeout(self.handshake_timeout)
            tune(sock)
            try:
                if self.ssl_context is not None:
                    sock = self.ssl_context.wrap_socket(sock, server_side=True)
                    self._connections.replace(me, sock)
                    channel = Channel(sock, self.limits)
                hello = server_handshake(channel, self._secret, self.node_id,
                                         admit=admit)
            except (ProtocolError, ssl.SSLError, ConnectionLost, OSError) as exc:
                if authenticated:  # lost while sending the ACK: a peer that went away
                    return
                cut, stopping = self._connections.handshake_failed(me)  # deadline, displaced
                if stopping:
                    return
                if cut:
                    self.auth_failures(peer, f"HandshakeDeadline: not authenticated "
                                             f"within {self.handshake_timeout} s")
                    return
                if isinstance(exc, OSError) and not isinstance(exc, ssl.SSLError):
                    return
                if isinstance(exc, ConnectionLost) and not channel.bytes_received:
                    return  # connected and left without a word: a port probe, not a peer
                # Anything else that does not end in a proven peer is a failed authentication,
                # including a client that hangs up on our challenge (it holds another secret).
                log.warning("replica server %s: rejected %s: %s", self.node_id, peer, exc)
                self.auth_failures(peer, f"{type(exc).__name__}: {exc}")
                if isinstance(exc, UnsupportedVersion):
                    # Says which version this end speaks, so the other side's log is clear too.
                    channel.send_error("version", str(exc))
                    channel.linger_close()
                elif isinstance(exc, ProtocolError):
                    channel.send_error("auth", "authentication failed")
                    channel.linger_close()
                return
            if hello is None:
                log.warning("replica server %s: turned away authenticated %s (over %d peers, "
                            "past its handshake deadline, or stopping)", self.node_id, peer,
                            self.max_connections)
                return
            sock.settimeout(self.idle_timeout)
            while not self._connections.stopping:
                try:
                    header = channel.recv_header()
                except TransferTimeout:
                    log.info("replica server %s: closing idle connection from %s",
                             self.node_id, peer)
                    return
                except ConnectionLost:
                    return  # the peer hung up between requests: normal
                if hello.scope is None:
                    self._connections.hear(hello.node_id)
                msg = channel.recv_message(header)
                if hello.scope is not None:
                    # A session its node opened for one job's restore, maybe held by that
                    # job's worker now: it fetches that job's copies and does nothing else,
                    # and is no sign of its node's life (not heard).
                    if not (isinstance(msg, Fetch) and msg.job == hello.scope):
                        raise ScopeViolation(f"a session scoped to job {hello.scope!r} sent "
                                             f"{_request(msg)}")
                    self._serve_fetch(channel, msg, hello.max_frame, hello.node_id)
                elif isinstance(msg, PutBegin):
                    self._receive(channel, msg, hello.node_id)
                    # Received whole: its last frame just came.
                    self._connections.hear(hello.node_id)
                elif isinstance(msg, Fetch):
                    self._serve_fetch(channel, msg, hello.max_frame, hello.node_id)
                elif isinstance(msg, CommitReport):
                    self._serve_report(channel, msg, hello.node_id)
                    self._connections.hear(hello.node_id)
                else:
                    raise UnexpectedFrame(f"expected PUT_BEGIN, FETCH or REPORT, received "
                                          f"{msg.TYPE.name}")
        except ProtocolError as exc:
            log.warning("replica server %s: protocol error from %s: %s", self.node_id, peer, exc)
            self._connections.bump(protocol_errors=1)
            channel.send_error("protocol", str(exc))
            channel.linger_close()
        except (ConnectionLost, OSError) as exc:
            log.info("replica server %s: connection from %s ended: %s", self.node_id, peer, exc)
        except Exception as exc:  # a sink bug must not take the server down
            log.exception("replica server %s: serving %s failed", self.node_id, peer)
            channel.send_error("internal", f"{type(exc).__name__}")
        finally:
            self._connections.bump(bytes_received=channel.bytes_received)
            channel.close()
            self._connections.end(me, authenticated)

    def _receive(self, channel: Channel, begin: PutBegin, peer_id: str) -> None:
        d = begin.descriptor
        try:
            target = self.sink.begin(d)
        except Refused as exc:
            self._connections.bump(pushes_refused=1)
            channel.send(Nack(exc.reason, exc.message))
            return
        started = self.clock.monotonic()
        # A pretagged push's block tags, each kept once its block checked against it, so that
        # this copy's fetches and the pushes this node makes of it later send them on.
        landed: dict[int, tuple[int, bytes]] = {}
        if begin.tag_salt is not None:
            channel.block_key = self._blocks.key(begin.tag_salt)
            channel.landed_tags = landed
        try:
            channel.send(Ack({"ready": True}))
            receive_stream(channel, d.total_bytes, target)
        except BaseException as exc:
            # Torn, corrupt or interrupted: the partial bytes must never become a copy. The
            # view is dropped first so that a shared-memory sink may unmap or reuse it.
            target = None
            self.sink.abort(d, f"{type(exc).__name__}: {exc}")
            self._connections.bump(pushes_aborted=1)
            raise
        finally:
            channel.block_key = channel.landed_tags = None
        del target
        tags = BlockTags(begin.tag_salt, landed) if begin.tag_salt is not None else None
        try:
            self.sink.landed(d, tags)
        except Refused as exc:  # a newer version was committed meanwhile
            self._connections.bump(pushes_refused=1)
            channel.send(Nack(exc.reason, exc.message))
            return
        self._connections.bump(pushes_committed=1)
        log.debug("replica server %s: committed rank %d %s from %s (%d bytes, %.3f s)",
                  self.node_id, d.owner_rank, d.version, peer_id, d.total_bytes,
                  self.clock.monotonic() - started)
        channel.send(Ack({"bytes": d.total_bytes}))

    def _serve_report(self, channel: Channel, msg: CommitReport, peer_id: str) -> None:
        report = decode_report(msg.body)  # MalformedReport is a ProtocolError
        if report.node != peer_id:
            # One node may not speak for another: the report names the authenticated peer.
            raise UnexpectedFrame(f"a commit report from {peer_id!r} names node "
                                  f"{report.node[:70]!r}")
        handler = self.on_report
        if handler is None:
            channel.send(Nack(NOT_COORDINATOR, f"{self.node_id} takes no commit reports"))
            return
        channel.send(CommitReply(encode_reply(handler(report))))

    def last_heard(self, node: str) -> float | None:
        """When a frame from authenticated peer ``node`` last arrived (wall time), or None."""
        return self._connections.last_heard(node)

    def serving(self) -> list[dict[str, Any]]:
        """The fetches being served now: peer, job, rank, version and seconds so far (a
        transfer to a peer that stopped reading stays here until the send fails)."""
        return self._connections.serving()

    def _serve_fetch(self, channel: Channel, req: Fetch, peer_max_frame: int,
                     peer_id: str = "") -> None:
        version = None if req.generation is None else (req.generation, req.step)  # both or none
        found = self.sink.read(req.job, req.owner_rank, version)
        if found is None:
            channel.send(Nack(NOT_FOUND, f"no committed copy of rank {req.owner_rank} "
                                         f"{version or 'at any version'} of job {req.job!r}"))
            return
        d, view = found
        try:
            try:
                ranges = req.byte_ranges(d.total_bytes)
            except ValueError as exc:  # the connection stays usable: the request was well formed
                channel.send(Nack(BAD_RANGE, f"rank {req.owner_rank} {d.version} of job "
                                             f"{req.job!r}: {exc}"))
                return
            self._connections.fetching(peer_id, req.job, req.owner_rank, d.version)
            # The whole descriptor (the client sizes and checks by it), and the salt of the
            # copy's block tags when this node kept them: the blocks then go as they lie,
            # not read here, each with the tag its owner made when it sealed the snapshot.
            tags = self.sink.tags(d)
            channel.send(FetchReply(d, tags.salt if tags is not None else None))
            send_spans(channel, [(start, view[start:end]) for start, end in ranges],
                       frame_chunk(self.chunk_size, peer_max_frame), tags, peer_max_frame)
        finally:
            self._connections.fetched()
            self.sink.release(d)
