"""Per-frame authentication of a replication connection: session keys and frame tags.

After the handshake (:mod:`elasticd.replication.auth`) every frame, control and DATA alike,
carries a 16-byte AES-GMAC tag instead of a checksum: AES-GCM with the frame's 12 header bytes
and its payload as associated data and nothing to encrypt. The keys come from HKDF-SHA256 over
the cluster secret, salted with both sides' fresh nonces and bound to the handshake transcript,
one key per direction; the GCM nonce of a frame is its sequence number in that direction. So:

* a frame altered in flight (any header or payload bit) fails its tag;
* a frame replayed, dropped, reordered or moved to the other direction or another connection
  fails too, because its tag was made under another nonce or key;
* nonces never repeat under a key: a counter per direction, and the connection is refused
  before it could wrap (2**64 frames).

GMAC rather than HMAC because it is the fastest keyed authenticator a maintained binding offers
here (one core, 4 MiB: GMAC ~6.5 GB/s, Poly1305 5.9, HMAC-SHA256 1.4; docs/replication.md). The
tag is fed piece by piece as bytes arrive (``authenticate_additional_data`` streams), so DATA is
still received straight into its destination and checked there, uncopied; streams run the pass
on a helper thread beside the socket copy (:mod:`elasticd.replication.overlap`), which works
because ``cryptography`` releases the GIL while it authenticates. It authenticates; it does not
encrypt (see docs/replication.md for the confidentiality choice).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

TAG_BYTES = 16
KEY_BYTES = 32  # AES-256
_MAX_FRAMES = 2**64 - 1
_INFO = b"elasticd-replication-v2 session keys\0"


class FrameKey:
    """One direction of a connection: an AES key and the sequence number of the next frame.

    The sender and the receiver of that direction each hold one, built from the same key, and
    advance in step: frame ``n`` is sealed and opened under nonce ``n``.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"frame key must be {KEY_BYTES} bytes, got {len(key)}")
        self._algorithm = algorithms.AES(key)
        self._sequence = 0

    @property
    def sequence(self) -> int:
        """Frames sealed or opened so far."""
        return self._sequence

    def _nonce(self) -> bytes:
        if self._sequence >= _MAX_FRAMES:
            raise OverflowError("frame sequence exhausted: reconnect for fresh keys")
        nonce = struct.pack("!IQ", 0, self._sequence)
        self._sequence += 1
        return nonce

    def seal(self, *parts: Any) -> bytes:
        """The tag of the next frame, whose bytes are ``parts`` (read where they lie)."""
        encryptor = Cipher(self._algorithm, modes.GCM(self._nonce())).encryptor()
        for part in parts:
            encryptor.authenticate_additional_data(part)
        encryptor.finalize()
        return encryptor.tag

    def opener(self, tag: bytes) -> "Opener":
        """Starts checking the next frame against ``tag``; feed its bytes, then verify."""
        return Opener(Cipher(self._algorithm, modes.GCM(self._nonce(), tag)).decryptor())


class Opener:
    """Checks one incoming frame: ``update`` with its bytes in order, then ``verify``."""

    def __init__(self, decryptor: Any) -> None:
        self._decryptor = decryptor

    def update(self, part: Any) -> None:
        self._decryptor.authenticate_additional_data(part)

    def verify(self) -> bool:
        """True when the bytes fed are exactly the frame its sender sealed, at this position."""
        try:
            self._decryptor.finalize()
        except InvalidTag:
            return False
        return True


class SessionKeys:
    """The keys of one authenticated connection, derived from the secret and the handshake.

    Args:
        secret: the cluster secret.
        client_nonce, server_nonce: both sides' fresh nonces (HKDF's salt): neither side alone
            decides the keys, so a replayed half of a handshake yields keys nobody holds.
        transcript: the handshake's HELLO and CHALLENGE payloads (ids, nonces, limits, version),
            bound into the keys and the proofs so that a relay cannot alter any of them.

    Attributes:
        proof_key: keys the HMAC proofs of the handshake.
        client_to_server, server_to_client: the AES keys of each direction.
    """

    def __init__(self, secret: bytes, client_nonce: bytes, server_nonce: bytes,
                 transcript: bytes) -> None:
        okm = HKDF(algorithm=hashes.SHA256(), length=3 * KEY_BYTES,
                   salt=client_nonce + server_nonce,
                   info=_INFO + hashlib.sha256(transcript).digest()).derive(secret)
        self.proof_key = okm[:KEY_BYTES]
        self.client_to_server = okm[KEY_BYTES : 2 * KEY_BYTES]
        self.server_to_client = okm[2 * KEY_BYTES :]
