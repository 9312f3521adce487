"""Daemon-to-daemon snapshot transfer over TCP: the client, and the transport's public names.

A :class:`ReplicaClient` is one authenticated connection to a peer's
:class:`~elasticd.replication.server.ReplicaServer`. It pushes a snapshot as a pipelined stream
of DATA frames sent from where the bytes lie: one round trip opens the transfer (so a stale
snapshot is refused before its bytes are sent), no chunk waits for an acknowledgement, and one
ACK at the end says the peer verified every checksum and committed the copy. It fetches a
committed copy straight into caller memory. Every send and receive is bounded by a timeout.

The server lives in :mod:`elasticd.replication.server`; both are importable from here.
"""

from __future__ import annotations

import socket
import ssl
import threading
from typing import Any, Callable, Sequence

from elasticd.clock import Clock, SystemClock
from elasticd.replication.api import (
    ConnectionLost,
    DeadlineExceeded,
    Descriptor,
    Refused,
    RemoteError,
    ReplicationError,
    Version,
)
from elasticd.replication.auth import check_secret, client_handshake
from elasticd.replication.channel import (
    Channel,
    frame_chunk,
    receive_spans,
    receive_stream,
    send_stream,
    tune,
)
from elasticd.replication.messages import (
    Ack,
    CommitReply,
    CommitReport,
    Error,
    Fetch,
    FetchReply,
    Nack,
    PutBegin,
    joined_ranges,
)
from elasticd.replication.report import Reply, Report, decode_reply, encode_report
from elasticd.replication.scatter import landing
from elasticd.replication.seal import BlockTagger, BlockTags
from elasticd.replication.server import DEFAULT_CHUNK, ReplicaServer, ServerStats
from elasticd.replication.wire import (
    DEFAULT_MAX_CONTROL,
    DEFAULT_MAX_FRAME,
    Limits,
    ProtocolError,
)

__all__ = ["DEFAULT_CHUNK", "ReplicaClient", "ReplicaServer", "ServerStats"]


class ReplicaClient:
    """An authenticated connection to one peer's :class:`ReplicaServer`.

    Not thread-safe for concurrent calls (they are serialised). After any error other than a
    :class:`Refused` the connection is unusable: close it and connect again.
    """

    def __init__(self, channel: Channel, peer_id: str, peer_max_frame: int,
                 clock: Clock | None = None, blocks: BlockTagger | None = None) -> None:
        self.channel = channel
        self.peer_id = peer_id
        self.peer_max_frame = peer_max_frame
        self.clock = clock or SystemClock()
        #: Checks the block tags of a fetch served pretagged (None: such a fetch is refused).
        self.blocks = blocks
        #: The job the session may fetch only (``Hello.scope``, confirmed by the server), or
        #: None: an unscoped session.
        self.scope: str | None = None
        #: The block-tag salt of the copy the last fetch was served (None: served untagged).
        self.tag_salt: bytes | None = None
        self._lock = threading.Lock()
        self._broken: BaseException | None = None

    @classmethod
    def connect(cls, host: str, port: int, secret: bytes, node_id: str, *,
                expected_peer: str | None = None, timeout: float = 30.0,
                max_frame: int = DEFAULT_MAX_FRAME, max_control: int = DEFAULT_MAX_CONTROL,
                ssl_context: ssl.SSLContext | None = None, server_hostname: str | None = None,
                clock: Clock | None = None, scope: str | None = None) -> "ReplicaClient":
        """Connects and authenticates both ways.

        Args:
            timeout: seconds any single send or receive may block, here and later.
            expected_peer: refuse a server announcing another node id.
            ssl_context: client-side TLS context (``server_hostname`` defaults to ``host``).
            scope: a job: the session may only fetch that job's copies; the server confirms
                it or the connection is refused (:class:`~elasticd.replication.messages.Hello`).

        Raises:
            ConnectionLost: cannot connect.
            AuthenticationFailed: either side failed to prove the secret.
        """
        secret = check_secret(secret)
        limits = Limits(max_frame, max_control)
        try:
            sock: Any = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to replica server {host}:{port}: {exc}") from exc
        try:
            tune(sock)
            if ssl_context is not None:
                sock = ssl_context.wrap_socket(sock, server_hostname=server_hostname or host)
            channel = Channel(sock, limits)
            challenge = client_handshake(channel, secret, node_id, expected_peer, scope)
        except BaseException:
            sock.close()
            raise
        client = cls(channel, challenge.node_id, challenge.max_frame, clock or SystemClock(),
                     BlockTagger(secret))
        client.scope = scope
        return client

    def push(self, descriptor: Descriptor, header: Any, payload: Any,
             chunk_size: int = DEFAULT_CHUNK, tags: BlockTags | None = None,
             deadline: float | None = None) -> float:
        """Sends one snapshot (``header`` then ``payload``, both bytes-like, sent uncopied).

        Returns the push's seconds, once the peer verified every chunk and committed the copy.

        Args:
            tags: the snapshot's block tags, made when it was sealed: the blocks they cover
                go pretagged (not read here, only sent); the rest are tagged as they go.
            deadline: seconds the whole push may take (None: each send and receive is
                bounded by the socket timeout alone).

        Raises:
            Refused: the peer declined it (``stale``, ``exists``, ``no_space``...); the
                connection stays usable.
            ValueError: the descriptor's sizes do not match the buffers.
            ReplicationError: anything else; the connection is then unusable.
        """
        head, body = memoryview(header).cast("B"), memoryview(payload).cast("B")
        if (descriptor.header_bytes, descriptor.total_bytes) != (len(head), len(head) + len(body)):
            raise ValueError(f"descriptor says {descriptor.header_bytes} + "
                             f"{descriptor.total_bytes - descriptor.header_bytes} bytes, buffers "
                             f"hold {len(head)} + {len(body)}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        chunk = frame_chunk(chunk_size, self.peer_max_frame)

        def run() -> float:
            started = self.clock.monotonic()
            self.channel.send(PutBegin(descriptor, tags.salt if tags is not None else None))
            self._reply(Ack)
            send_stream(self.channel, (head, body), chunk, tags, max_frame=self.peer_max_frame)
            self._reply(Ack)
            return self.clock.monotonic() - started

        return self._call(run, deadline)

    def fetch(self, job: str, owner_rank: int,
              into: memoryview | bytearray | Callable[[Descriptor], Any],
              version: Version | None = None, byte_range: tuple[int, int] | None = None,
              deadline: float | None = None,
              ranges: Sequence[tuple[int, int]] | None = None) -> Descriptor:
        """Reads a committed copy, or a range of its bytes, from the peer into caller memory.

        Args:
            into: a writable buffer of at least the snapshot's size, or a function given the
                descriptor (sizes) that returns one.
            version: (generation, step) wanted; None for the newest the peer holds.
            byte_range: (offset, length): only the snapshot's bytes ``[offset, offset +
                length)``, received into that same slice of ``into`` (the rest of it is left
                as it was); a zero length reads the descriptor alone. None: the whole
                snapshot.
            deadline: seconds the whole fetch may take (None: each receive is bounded by
                the socket timeout alone).
            ranges: instead of ``byte_range``, several ``(offset, length)`` ranges in one
                request, each non-empty, ascending and apart (adjacent ones are joined
                here), each received into its own slice of ``into``.

        Returns:
            The descriptor of the whole snapshot (whose bytes, or the range asked for, are now
            in ``into``).

        Raises:
            Refused: ``not_found``, or ``bad_range`` (the range lies outside the snapshot);
                the connection stays usable.
            ValueError: a negative offset or length.
            DeadlineExceeded: the deadline passed; the connection is then unusable (closed:
                nothing more lands in ``into`` after this returns).
            ReplicationError: anything else; the connection is then unusable.
        """
        offset, length = byte_range if byte_range is not None else (None, None)
        if byte_range is not None and (offset < 0 or length < 0):
            raise ValueError(f"byte range (offset, length) must be >= 0, got {byte_range}")
        asked = None if ranges is None else joined_ranges(ranges)
        if asked is not None and byte_range is not None:
            raise ValueError("fetch takes byte_range or ranges, not both")

        def run() -> Descriptor:
            gen, step = version if version is not None else (None, None)
            self.channel.send(Fetch(job, owner_rank, gen, step, offset, length, asked))
            reply = self._reply(FetchReply)
            d = reply.descriptor
            if d.shard != (job, owner_rank) or (version is not None
                                                and d.version != tuple(version)):
                raise ProtocolError(f"asked for rank {owner_rank} {version} of {job!r}, "
                                    f"peer offers {d}")
            start, end = (0, d.total_bytes) if byte_range is None else (offset, offset + length)
            if asked is not None:
                start, end = asked[0][0], asked[-1][0] + asked[-1][1]
            if end > d.total_bytes:  # the server refuses such a range: one that serves it lies
                raise ProtocolError(f"asked for bytes [{start}, {end}), peer offers a snapshot "
                                    f"of {d.total_bytes}")
            target = landing(into(d) if callable(into) else into)
            if target.readonly or len(target) < end:
                raise ReplicationError(f"fetch buffer of {len(target)} bytes (readonly="
                                       f"{target.readonly}) cannot take bytes [{start}, {end}) "
                                       f"of a snapshot of {d.total_bytes}")
            # Pretagged blocks (the holder kept their tags) are checked against the tags
            # their owner sealed them with, as they land; anything else by its session tag.
            self.tag_salt = reply.tag_salt
            if reply.tag_salt is not None and self.blocks is not None:
                self.channel.block_key = self.blocks.key(reply.tag_salt)
            try:
                if asked is None:
                    receive_stream(self.channel, end - start, target[start:end], base=start)
                else:
                    receive_spans(self.channel, target, [(o, o + n) for o, n in asked])
            finally:
                self.channel.block_key = None
            return d

        return self._call(run, deadline)

    def retire(self, reason: BaseException, last: Callable[[Channel], Any]) -> Any:
        """Runs ``last`` with the channel between calls, then makes this client unusable
        (later calls raise ConnectionLost naming ``reason``); the socket stays open until
        :meth:`close`. Returns what ``last`` returned.

        Raises:
            ConnectionLost: the client is unusable already.
        """
        with self._lock:
            if self._broken is not None:
                raise ConnectionLost(f"connection to {self.peer_id} is unusable after: "
                                     f"{self._broken}")
            out = last(self.channel)
            self._broken = reason
        return out

    def describe(self, job: str, owner_rank: int, version: Version | None = None,
                 deadline: float | None = None) -> Descriptor:
        """The descriptor of the peer's copy, no byte of it (:attr:`tag_salt` then says
        under which salt its blocks are tagged).

        Raises: as :meth:`fetch`.
        """
        return self.fetch(job, owner_rank, bytearray(0), version, byte_range=(0, 0),
                          deadline=deadline)

    def report(self, report: Report, deadline: float | None = None) -> Reply:
        """Sends a commit report to the peer (its job's coordinator) and returns its reply.

        Raises:
            Refused: the peer coordinates nothing (``not_coordinator``); the connection stays
                usable.
            ReplicationError: anything else; the connection is then unusable.
        """
        def run() -> Reply:
            self.channel.send(CommitReport(encode_report(report)))
            return decode_reply(self._reply(CommitReply).body)

        return self._call(run, deadline)

    def _reply(self, expected: type) -> Any:
        """The peer's next frame, of type ``expected``; a NACK raises :class:`Refused`."""
        reply = self.channel.recv(expected, Nack)
        if isinstance(reply, Nack):
            raise Refused(reply.reason, reply.message)
        return reply

    def _call(self, run: Callable[[], Any], deadline: float | None = None) -> Any:
        with self._lock:
            if self._broken is not None:
                raise ConnectionLost(f"connection to {self.peer_id} is unusable after: "
                                     f"{self._broken}")
            try:
                with self.channel.within(deadline):
                    return run()
            except Refused:
                raise
            except BaseException as exc:
                self._broken = exc
                # A lost connection's peer may have said why before closing (it reads on while
                # it lingers); one past its deadline stopped answering: asking would only wait.
                remote = (self._pending_error() if isinstance(exc, ConnectionLost)
                          and not isinstance(exc, DeadlineExceeded) else None)
                self.channel.close()
                if remote is not None:
                    raise remote from exc
                raise

    def _pending_error(self) -> RemoteError | None:
        try:
            self.channel.sock.settimeout(0.5)
            msg = self.channel.recv(Error)
        except (ReplicationError, OSError):
            return None
        return RemoteError(msg.code, msg.message) if isinstance(msg, Error) else None

    def close(self) -> None:
        """Closes the connection without waiting for a call in flight on another thread.

        That call may be waiting on a peer that stopped answering (frozen: its socket stays
        open) for up to the whole timeout; closing first shuts the socket down, which ends
        that wait with ConnectionLost at once, and only then takes the lock. (A fetch that had
        to drop a frozen peer's pooled connection waited 30 s here for a push's ack.)
        """
        self._broken = self._broken or ConnectionLost("closed")
        self.channel.shutdown()
        with self._lock:
            self.channel.close()

    def __enter__(self) -> "ReplicaClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
