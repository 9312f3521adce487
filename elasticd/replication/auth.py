"""Mutual challenge–response authentication of replication peers from a cluster secret.

Both daemons prove they know the secret without sending it, and each proof is bound to this
very connection, so recorded bytes are worthless later::

    C → S  HELLO(client id, Nc)               Nc, Ns: 32 fresh bytes from os.urandom
    S → C  CHALLENGE(server id, Ns, Ps)       Ps = HMAC(secret, "server" | ids | Nc | Ns | v)
    C → S  AUTH(Pc)                           Pc = HMAC(secret, "client" | ids | Nc | Ns | v)
    S → C  ACK                                (or ERROR "auth", then close)

The role in the MAC stops one side's proof from being reflected back as the other's; the
server's fresh ``Ns`` makes a replayed client conversation fail; the client's fresh ``Nc``
does the same for a replayed server. Proofs are compared with ``hmac.compare_digest``.

This authenticates peers; it does not encrypt. For confidentiality, pass an
``ssl.SSLContext`` to the server and client (TLS wraps the socket before the handshake
above, which still runs inside it so that a certificate alone does not admit a peer). The proofs
are not bound to the TLS session, so the TLS context must verify certificates to stop a
man in the middle.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
from typing import Callable

from elasticd.replication.api import RemoteError
from elasticd.replication.channel import Channel
from elasticd.replication.messages import Ack, Auth, Challenge, Hello
from elasticd.replication.wire import NONCE_BYTES, VERSION, ProtocolError

CLIENT = b"client"
SERVER = b"server"
MIN_SECRET_BYTES = 16
_DOMAIN = b"elasticd-replication-auth\0"


class AuthenticationFailed(ProtocolError):
    """The peer could not prove it knows the cluster secret (or is not who it should be)."""


def check_secret(secret: bytes) -> bytes:
    """Validates a cluster secret (never quoting it).

    Raises:
        ValueError: not bytes, or shorter than :data:`MIN_SECRET_BYTES`.
    """
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the replication secret must be at least {MIN_SECRET_BYTES} bytes")
    return bytes(secret)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def proof(secret: bytes, role: bytes, client_id: str, server_id: str,
          client_nonce: bytes, server_nonce: bytes, version: int = VERSION) -> bytes:
    """HMAC-SHA256 of one side's view of the handshake (fields length-prefixed: unambiguous)."""
    mac = hmac.new(secret, _DOMAIN, hashlib.sha256)
    for field in (role, client_id.encode(), server_id.encode(), client_nonce, server_nonce):
        mac.update(struct.pack("!H", len(field)))
        mac.update(field)
    mac.update(struct.pack("!B", version))
    return mac.digest()


class AuthFailures:
    """Counts rejected handshakes (thread-safe) and tells an optional callback about each.

    Args:
        on_failure: called with (peer address, reason) for every rejection, e.g. to bump a
            Prometheus counter; exceptions it raises are not caught.
    """

    def __init__(self, on_failure: Callable[[str, str], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._on_failure = on_failure
        self.last_reason = ""

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    def record(self, peer: str, reason: str) -> None:
        with self._lock:
            self._count += 1
            self.last_reason = reason
        if self._on_failure is not None:
            self._on_failure(peer, reason)


def client_handshake(channel: Channel, secret: bytes, node_id: str,
                     expected_peer: str | None = None) -> Challenge:
    """Runs the client side; returns the server's CHALLENGE (its node id and frame limit).

    Raises:
        AuthenticationFailed: the server's proof is wrong, it is not ``expected_peer``, or it
            rejected ours.
        ProtocolError, ConnectionLost: as the channel raises them.
    """
    nonce = new_nonce()
    channel.send(Hello(node_id, nonce, channel.limits.max_frame))
    challenge = channel.recv(Challenge)
    assert isinstance(challenge, Challenge)
    if challenge.nonce == nonce:
        raise AuthenticationFailed("server echoed our nonce: a reflection attempt")
    expected = proof(secret, SERVER, node_id, challenge.node_id, nonce, challenge.nonce)
    if not hmac.compare_digest(expected, challenge.proof):
        raise AuthenticationFailed(f"server {challenge.node_id!r} did not prove knowledge of the "
                                   "cluster secret (different secrets, or not an elasticd peer)")
    if expected_peer is not None and challenge.node_id != expected_peer:
        raise AuthenticationFailed(f"connected to {challenge.node_id!r}, expected "
                                   f"{expected_peer!r}")
    channel.send(Auth(proof(secret, CLIENT, node_id, challenge.node_id, nonce, challenge.nonce)))
    try:
        channel.recv(Ack)
    except RemoteError as exc:  # the server's ERROR "auth" before it closes
        raise AuthenticationFailed(f"server {challenge.node_id!r} rejected our proof: "
                                   f"{exc}") from exc
    return challenge


def server_handshake(channel: Channel, secret: bytes, node_id: str) -> Hello:
    """Runs the server side; returns the client's HELLO (its node id and frame limit).

    Raises:
        AuthenticationFailed: the client's proof is wrong (the caller counts it, sends ERROR
            and closes).
        ProtocolError, ConnectionLost: as the channel raises them.
    """
    hello = channel.recv(Hello)
    assert isinstance(hello, Hello)
    nonce = new_nonce()
    channel.send(Challenge(node_id, nonce,
                           proof(secret, SERVER, hello.node_id, node_id, hello.nonce, nonce),
                           channel.limits.max_frame))
    auth = channel.recv(Auth)
    assert isinstance(auth, Auth)
    expected = proof(secret, CLIENT, hello.node_id, node_id, hello.nonce, nonce)
    if not hmac.compare_digest(expected, auth.proof):
        raise AuthenticationFailed(f"client {hello.node_id!r} did not prove knowledge of the "
                                   "cluster secret")
    channel.send(Ack({"node_id": node_id}))
    return hello
