"""Mutual challenge–response authentication of replication peers, and the session keys.

Both daemons prove they know the cluster secret without sending it; the client proves first
(``AUTH``), and the server says nothing derived from the secret until that proof has verified:
its proof is its ACK, sealed under ``K_sc``. The handshake, its key derivation (the transcript
is the HELLO and CHALLENGE payloads and the protocol version) and why the client proves first:
docs/replication.md, "Transport". From then on every frame each way is sealed
(:mod:`elasticd.replication.seal`); the secret must carry 128 bits (:func:`check_secret`).

The role in the MAC stops a proof being reflected back; the server's fresh ``Ns`` makes a
replayed client conversation fail; the client's fresh ``Nc`` does the same for a replayed
server. Proofs are compared with ``hmac.compare_digest``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import Callable

from elasticd.replication.api import RemoteError
from elasticd.replication.channel import Channel
from elasticd.replication.messages import Ack, Auth, Challenge, Error, Hello
from elasticd.replication.seal import FrameKey, SessionKeys
from elasticd.replication.secret_strength import weak_secret
from elasticd.replication.wire import NONCE_BYTES, VERSION, ForgedFrame, ProtocolError

CLIENT = b"client"
_DOMAIN = b"elasticd-replication-auth\0"


class AuthenticationFailed(ProtocolError):
    """The peer could not prove it knows the cluster secret (or is not who it should be)."""


def check_secret(secret: bytes) -> bytes:
    """Validates a cluster secret (never quoting it); its bytes are used as they are.

    Raises:
        ValueError: not bytes, or fewer than 128 bits counted from its alphabet
            (:mod:`elasticd.replication.secret_strength`).
    """
    if not isinstance(secret, (bytes, bytearray)):
        raise ValueError("the replication secret must be bytes")
    weak = weak_secret(secret)
    if weak:
        raise ValueError(f"the replication secret is too weak: {weak}")
    return bytes(secret)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def transcript(hello: Hello, challenge: Challenge) -> bytes:
    """The handshake's public values, length-prefixed (unambiguous), that keys and proofs bind."""
    fields = b"".join(struct.pack("!I", len(f)) + f for f in (hello.payload(), challenge.payload()))
    return _DOMAIN + fields + struct.pack("!B", VERSION)


def proof(keys: SessionKeys, role: bytes, transcript_bytes: bytes) -> bytes:
    """HMAC-SHA256 of a role and the handshake transcript, under the session's proof key."""
    return hmac.new(keys.proof_key, role + b"\0" + transcript_bytes, hashlib.sha256).digest()


def client_handshake(channel: Channel, secret: bytes, node_id: str,
                     expected_peer: str | None = None, scope: str | None = None) -> Challenge:
    """Runs the client side; returns the server's CHALLENGE (its node id and frame limit).

    On return the channel seals and opens every frame with the session keys.

    Args:
        scope: a job: the session may only fetch that job's copies (:class:`Hello`); the
            server must say so in its sealed ACK.

    Raises:
        AuthenticationFailed: the server rejected our proof, failed to prove itself, is
            not ``expected_peer``, or did not take the ``scope`` (an older version).
        ProtocolError, ConnectionLost: as the channel raises them.
    """
    hello = Hello(node_id, new_nonce(), channel.limits.max_frame, scope)
    channel.send(hello)
    challenge = channel.recv(Challenge)
    assert isinstance(challenge, Challenge)
    if challenge.nonce == hello.nonce:
        raise AuthenticationFailed("server echoed our nonce: a reflection attempt")
    if expected_peer is not None and challenge.node_id != expected_peer:
        # Before our proof: a server that is not the peer we meant gets nothing from us.
        raise AuthenticationFailed(f"connected to {challenge.node_id!r}, expected "
                                   f"{expected_peer!r}")
    seen = transcript(hello, challenge)
    keys = SessionKeys(secret, hello.nonce, challenge.nonce, seen)
    channel.send(Auth(proof(keys, CLIENT, seen)))
    channel.send_key = FrameKey(keys.client_to_server)
    header = channel.recv_header()
    if not header.sealed:
        # Only a rejection may come unsealed (the server then holds no session with us).
        msg = channel.recv_message(header)
        reason = f"{msg.code}: {msg.message}" if isinstance(msg, Error) else msg.TYPE.name
        raise AuthenticationFailed(f"server {challenge.node_id!r} rejected our proof ({reason}): "
                                   "different cluster secrets?")
    channel.recv_key = FrameKey(keys.server_to_client)
    try:
        msg = channel.recv_message(header)
    except ForgedFrame as exc:
        raise AuthenticationFailed(f"server {challenge.node_id!r} did not prove knowledge of the "
                                   "cluster secret (not an elasticd peer, or a relay)") from exc
    if isinstance(msg, Error):  # authenticated, but turned away (e.g. busy)
        raise RemoteError(msg.code, msg.message)
    if not isinstance(msg, Ack):
        raise AuthenticationFailed(f"server {challenge.node_id!r} answered our proof with "
                                   f"{msg.TYPE.name}")
    if scope is not None and msg.info.get("scope") != scope:
        raise AuthenticationFailed(f"server {challenge.node_id!r} did not confirm the session's "
                                   f"scope {scope!r} (an elasticd too old to keep it)")
    return challenge


def server_handshake(channel: Channel, secret: bytes, node_id: str,
                     admit: Callable[[], str | None] | None = None) -> Hello | None:
    """Runs the server side; returns the client's HELLO (its node id and frame limit).

    Nothing sent before the client's proof verifies depends on the secret. On return the
    channel seals and opens every frame with the session keys.

    Args:
        admit: called once the client has proved itself; a reason string turns it away with
            a sealed ERROR "busy" (the function then returns None).

    Raises:
        AuthenticationFailed: the client's proof is wrong (the caller counts it, sends ERROR
            and closes).
        ProtocolError, ConnectionLost: as the channel raises them.
    """
    hello = channel.recv(Hello)
    assert isinstance(hello, Hello)
    challenge = Challenge(node_id, new_nonce(), channel.limits.max_frame)
    channel.send(challenge)
    auth = channel.recv(Auth)
    assert isinstance(auth, Auth)
    seen = transcript(hello, challenge)
    keys = SessionKeys(secret, hello.nonce, challenge.nonce, seen)
    if not hmac.compare_digest(proof(keys, CLIENT, seen), auth.proof):
        raise AuthenticationFailed(f"client {hello.node_id!r} did not prove knowledge of the "
                                   "cluster secret")
    channel.send_key = FrameKey(keys.server_to_client)
    channel.recv_key = FrameKey(keys.client_to_server)
    refused = admit() if admit is not None else None
    if refused is not None:
        channel.send(Error("busy", refused))
        return None
    # A scoped session is confirmed under the session key, so a client that asked for one
    # knows this server keeps it. (An older server refuses the longer HELLO outright; the
    # confirmation guards against one that would parse it and drop the scope.)
    channel.send(Ack({"node_id": node_id} if hello.scope is None else
                     {"node_id": node_id, "scope": hello.scope}))
    return hello
