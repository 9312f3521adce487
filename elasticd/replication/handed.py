"""A replication session handed from the daemon to one of its job's processes.

A worker that receives its own rows (bench/results/restore41/: the workers' copy out of
restore scratch gone, the sharded CPU point from 1.26-1.56x the floor to 1.05-1.26x) needs a
session to the holders of its job's snapshots. It must never hold the cluster secret, so it
cannot open one: the daemon does, scoped to the job (``Hello.scope``: the holder serves that
job's fetches only on it), and hands it over: the socket's descriptor (sent over the local
socket with ``SCM_RIGHTS``) and a :class:`Ticket` with what the session's two ends hold past
the handshake (each direction's frame key and next sequence number, the frame limits) and the
block keys of the copies the daemon described for the job (by salt: what
:meth:`~elasticd.replication.seal.BlockTagger.key` derives from the secret). With them the
process can fetch its job's copies, check every block against its owner's tag and every frame
against its session tag, and nothing else: a scoped session cannot push, report or fetch
another job; the frame keys come from the session's fresh nonces and say nothing of the secret
or of any other session; a block key checks (and could forge) tags of its own job's snapshot
only, whose bytes the job wrote anyway. The daemon stops using the session once it is handed
over and keeps its socket, to cut the session off (:func:`cut_off`) when the restore's deadline
passes. TLS sessions cannot be handed over (their state lives in the library): they keep the
daemon's path.

Layer 2 of the design in bench/results/restore40/README.md. The daemon's operation that opens
and hands the sessions over is ``ckpt_sessions`` (:mod:`elasticd.recovery.handing`,
:mod:`elasticd.store.handed_sessions`); the worker's restore over them is
:mod:`elasticd.worker.direct`.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import ssl
from typing import Any, Mapping

from elasticd.replication.api import ConnectionLost, ReplicationError
from elasticd.replication.channel import Channel
from elasticd.replication.lanes import NoAddress
from elasticd.replication.seal import KEY_BYTES, SALT_BYTES, FrameKey
from elasticd.replication.transport import ReplicaClient
from elasticd.replication.wire import Limits


class HandedOver(ConnectionLost):
    """The daemon handed this session to another process: it no longer uses it."""


class UnknownCopy(ReplicationError):
    """A handed session was served a copy whose block key was not handed over with it."""


@dataclasses.dataclass(frozen=True)
class Ticket:
    """What a handed session's new owner needs beside its descriptor.

    Attributes:
        peer: the holder's node id, as its handshake proved it.
        scope: the job the session may fetch (the holder confirmed it).
        send, recv: (key, next sequence number) of each direction's frame key.
        limits: the largest frames this end accepts (as it told the holder).
        peer_max_frame: the largest DATA payload the holder accepts.
        block_keys: block key by salt, of the copies the daemon described for the job.
    """

    peer: str
    scope: str
    send: tuple[bytes, int]
    recv: tuple[bytes, int]
    limits: Limits
    peer_max_frame: int
    block_keys: Mapping[bytes, bytes]

    def to_json(self) -> dict[str, Any]:
        """A JSON object of the ticket (keys in hex), for the local socket."""
        return {"peer": self.peer, "scope": self.scope,
                "send": [self.send[0].hex(), self.send[1]],
                "recv": [self.recv[0].hex(), self.recv[1]],
                "limits": [self.limits.max_frame, self.limits.max_control],
                "peer_max_frame": self.peer_max_frame,
                "block_keys": {salt.hex(): key.hex() for salt, key in self.block_keys.items()}}

    @classmethod
    def from_json(cls, value: Any) -> "Ticket":
        """The ticket :meth:`to_json` wrote.

        Raises:
            ValueError: anything else, with what is wrong.
        """
        try:
            keys = {bytes.fromhex(s): bytes.fromhex(k) for s, k in value["block_keys"].items()}
            ticket = cls(str(value["peer"]), str(value["scope"]),
                         (bytes.fromhex(value["send"][0]), int(value["send"][1])),
                         (bytes.fromhex(value["recv"][0]), int(value["recv"][1])),
                         Limits(int(value["limits"][0]), int(value["limits"][1])),
                         int(value["peer_max_frame"]), keys)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed session ticket: {exc!r}") from exc
        if (len(ticket.send[0]) != KEY_BYTES or len(ticket.recv[0]) != KEY_BYTES
                or any(len(s) != SALT_BYTES or len(k) != KEY_BYTES for s, k in keys.items())):
            raise ValueError("malformed session ticket: a key or salt of the wrong length")
        return ticket


class HandedBlockKeys:
    """The block keys a handed session checks its copies with (in place of the
    :class:`~elasticd.replication.seal.BlockTagger` a daemon derives them with)."""

    def __init__(self, keys: Mapping[bytes, bytes]) -> None:
        self._keys = dict(keys)

    def key(self, salt: bytes) -> bytes:
        found = self._keys.get(bytes(salt))
        if found is None:
            raise UnknownCopy(f"a copy under block-tag salt {bytes(salt).hex()[:16]}... was "
                              "served, whose block key was not handed over with the session")
        return found


def hand_over(client: ReplicaClient, block_keys: Mapping[bytes, bytes]) -> tuple[int, Ticket]:
    """Daemon side: a duplicate of ``client``'s socket descriptor (the caller sends it and
    closes it) and the session's :class:`Ticket`. ``client`` is unusable afterwards; keep it
    to :func:`cut_off` the session.

    Raises:
        ValueError: the session is not scoped to a job, runs over TLS, is not authenticated or
            is unusable already.
    """
    if client.scope is None:
        raise ValueError(f"the session to {client.peer_id} is not scoped to a job: only a "
                         "scoped session may be handed over")
    sock = client.channel.sock
    if isinstance(sock, ssl.SSLSocket) or not isinstance(sock, socket.socket):
        raise ValueError(f"the session to {client.peer_id} runs over TLS, whose state cannot "
                         "be handed over")
    scope = client.scope

    def last(channel: Channel) -> tuple[int, Ticket]:
        if channel.send_key is None or channel.recv_key is None:
            raise ValueError(f"the session to {client.peer_id} is not usable: not "
                             "authenticated")
        ticket = Ticket(client.peer_id, scope, channel.send_key.state(),
                        channel.recv_key.state(), channel.limits, client.peer_max_frame,
                        dict(block_keys))
        return os.dup(sock.fileno()), ticket

    try:
        return client.retire(HandedOver(f"the session to {client.peer_id} was handed over"),
                             last)
    except ConnectionLost as exc:
        raise ValueError(f"the session to {client.peer_id} is not usable: {exc}") from exc


def release(client: ReplicaClient) -> None:
    """Daemon side: closes its own descriptor of a session it handed over, leaving the
    session to its new owner (no shutdown: the connection lives on in the other descriptor)."""
    client.channel.close()


def cut_off(client: ReplicaClient) -> None:
    """Daemon side: ends a session it handed over (shut down both ways: the new owner's next
    send or receive fails at once) and closes the daemon's own descriptor of it."""
    client.close()


def adopt(fd: int, ticket: Ticket, timeout: float = 30.0) -> ReplicaClient:
    """The new owner's side: a client over the handed descriptor ``fd`` (taken over: closed
    with the client), carrying the session on where the daemon left it."""
    sock = socket.socket(fileno=fd)
    try:
        sock.settimeout(timeout)
        channel = Channel(sock, ticket.limits)
        channel.send_key = FrameKey.resume(*ticket.send)
        channel.recv_key = FrameKey.resume(*ticket.recv)
    except BaseException:
        sock.close()
        raise
    client = ReplicaClient(channel, ticket.peer, ticket.peer_max_frame,
                           blocks=HandedBlockKeys(ticket.block_keys))  # type: ignore[arg-type]
    client.scope = ticket.scope
    return client


class HandedConnections:
    """The connection pool :func:`~elasticd.recovery.fetch.fetch_shard` takes, over handed
    sessions: a holder's session is the one handed over, never a new one (the process cannot
    open one), and a session dropped is gone for the rest of the restore."""

    def __init__(self, clients: Mapping[str, ReplicaClient]) -> None:
        self._clients = dict(clients)

    def get(self, peer: str, connect_timeout: float | None = None) -> tuple[ReplicaClient, bool]:
        client = self._clients.get(peer)
        if client is None:
            raise NoAddress(f"no session to {peer!r} was handed over (or it was dropped)")
        return client, False  # never "reused": there is no fresh one to retry on

    def discard(self, peer: str, client: ReplicaClient | None = None) -> None:
        found = self._clients.get(peer)
        if found is not None and (client is None or client is found):
            del self._clients[peer]
            found.close()

    def close(self) -> None:
        for peer in list(self._clients):
            self.discard(peer)
