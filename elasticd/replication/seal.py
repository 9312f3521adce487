"""Per-frame authentication of a replication connection: session keys and frame tags.

After the handshake (:mod:`elasticd.replication.auth`) every frame, control and DATA alike,
carries a 16-byte ChaCha20-Poly1305 tag (RFC 8439) instead of a checksum, under its direction's
key with the frame's sequence number as nonce (what that stops: docs/replication.md, "Every
frame"); the connection is refused before a direction's counter could wrap (2**64 frames).

The tag is exactly ``ChaCha20Poly1305(key).encrypt(nonce, b"", frame)`` (a test checks it
against the library's AEAD); it is computed here from its two library parts, ChaCha20 for the
one-time key and streaming Poly1305, because a frame's bytes lie in several buffers (header,
offset, the chunk where it lies) and arrive piece by piece: the one-shot AEAD would need them
joined, a copy of every chunk. So DATA is still received straight into its destination and
checked there, uncopied.

Why this primitive: the fastest keyed authenticator a maintained binding offers here, if not
by much (figures and what holding the GIL costs: docs/replication.md). It authenticates; it
does not encrypt (docs/replication.md says why).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import Any, Iterable

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.poly1305 import Poly1305

TAG_BYTES = 16
KEY_BYTES = 32  # ChaCha20
_MAX_FRAMES = 2**64 - 1
_INFO = b"elasticd-replication-v3 session keys\0"
_BLOCK_INFO = b"elasticd-replication-v4 snapshot block tags\0"
SALT_BYTES = 16
_ONE_TIME_KEY = bytes(32)  # ChaCha20 block 0 over zeros: the frame's Poly1305 key (RFC 8439 2.6)
_PAD = bytes(16)
_LENGTHS = struct.Struct("<QQ")


class FrameKey:
    """One direction of a connection: a ChaCha20 key and the sequence number of the next frame.

    The sender and the receiver of that direction each hold one, built from the same key, and
    advance in step: frame ``n`` is sealed and opened under nonce ``n``.

    A frame of at most :data:`ONE_SHOT_BYTES` (every control frame, and the header and prefix
    of a pretagged DATA frame, whose blocks carry their own tags) is sealed and opened with the
    library's one-shot AEAD, made once per key (the same tag at a tenth of the CPU: the figures
    are in docs/replication.md, "Transport"). Bigger frames (DATA tagged on the way) are
    streamed, read where they lie.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"frame key must be {KEY_BYTES} bytes, got {len(key)}")
        self._key = bytes(key)
        self._sequence = 0
        self._aead = ChaCha20Poly1305(self._key)

    @classmethod
    def resume(cls, key: bytes, sequence: int) -> "FrameKey":
        """The same direction carried on by another process from frame ``sequence`` (a
        session handed over: :mod:`elasticd.replication.handed`)."""
        if not 0 <= sequence < _MAX_FRAMES:
            raise ValueError(f"frame sequence {sequence} is out of range")
        out = cls(key)
        out._sequence = sequence
        return out

    def state(self) -> tuple[bytes, int]:
        """(key, the next frame's sequence number): what :meth:`resume` takes."""
        return self._key, self._sequence

    def _next(self) -> int:
        if self._sequence >= _MAX_FRAMES:
            raise OverflowError("frame sequence exhausted: reconnect for fresh keys")
        self._sequence += 1
        return self._sequence - 1

    def seal(self, *parts: Any) -> bytes:
        """The tag of the next frame, whose bytes are ``parts`` (read where they lie)."""
        nonce = self._next()
        views = [memoryview(part).cast("B") for part in parts]
        if sum(len(v) for v in views) <= ONE_SHOT_BYTES:
            return self._aead.encrypt(NONCE.pack(0, nonce), b"", b"".join(views))
        tagger = one_time_tagger(self._key, nonce)
        for view in views:
            tagger.update(view)
        return tagger.tag()

    def opener(self, tag: bytes) -> "_FrameOpener":
        """Starts checking the next frame against ``tag``; feed its bytes, then verify."""
        return _FrameOpener(self._aead, self._key, self._next(), tag)


#: Frames up to this size are sealed and opened in one AEAD call over their joined bytes
#: (joining them is a copy; above this, streaming them where they lie costs less).
ONE_SHOT_BYTES = 64 << 10
#: RFC 8439's 96-bit nonce: 4 zero bytes, then the 64-bit frame sequence number (or, for a
#: block tag, the block's snapshot offset).
NONCE = struct.Struct("<IQ")


def one_time_tagger(key: bytes, nonce: int) -> "Tagger":
    """Poly1305 under the one-time key ChaCha20 derives from ``key`` and the 64-bit ``nonce``."""
    # ChaCha20's 16-byte nonce here is RFC 8439's block counter (0: the key block) and then
    # its 96-bit nonce, which holds ``nonce``.
    chacha = Cipher(algorithms.ChaCha20(key, struct.pack("<IIQ", 0, 0, nonce)), mode=None)
    return Tagger(chacha.encryptor().update(_ONE_TIME_KEY))


class Tagger:
    """RFC 8439's Poly1305 over associated data alone (the AEAD with an empty plaintext)."""

    def __init__(self, one_time_key: bytes) -> None:
        self._mac = Poly1305(one_time_key)
        self._length = 0

    def update(self, part: Any) -> None:
        view = memoryview(part)
        self._mac.update(view)
        self._length += view.nbytes

    def tag(self) -> bytes:
        self._mac.update(_PAD[: -self._length % 16])
        self._mac.update(_LENGTHS.pack(self._length, 0))
        return self._mac.finalize()


class _FrameOpener:
    """An opener (``update`` with the frame's bytes in order, then ``verify``) of one frame that
    keeps the bytes of a small frame and checks them in one AEAD call, and streams a big one into
    Poly1305 from the first piece that makes it big (the frame's nonce is fixed when it is
    made)."""

    def __init__(self, aead: ChaCha20Poly1305, key: bytes, nonce: int, tag: bytes) -> None:
        self._aead, self._key, self._nonce = aead, key, nonce
        self._expected = bytes(tag)
        self._parts: list[bytes] = []
        self._size = 0
        self._tagger: Tagger | None = None

    def update(self, part: Any) -> None:
        if self._tagger is not None:
            self._tagger.update(part)
            return
        view = memoryview(part).cast("B")
        if self._size + len(view) <= ONE_SHOT_BYTES:
            self._parts.append(bytes(view))
            self._size += len(view)
            return
        self._tagger = one_time_tagger(self._key, self._nonce)
        for kept in self._parts:
            self._tagger.update(kept)
        self._parts = []
        self._tagger.update(view)

    def verify(self) -> bool:
        """True when the bytes fed are exactly the frame its sender sealed, at this position."""
        if self._tagger is not None:
            made = self._tagger.tag()
        else:
            made = self._aead.encrypt(NONCE.pack(0, self._nonce), b"", b"".join(self._parts))
        return hmac.compare_digest(made, self._expected)


class SessionKeys:
    """The keys of one authenticated connection, derived from the secret and the handshake.

    Args:
        client_nonce, server_nonce: both sides' fresh nonces (HKDF's salt): neither side alone
            decides the keys, so a replayed half of a handshake yields keys nobody holds.
        transcript: the handshake's HELLO and CHALLENGE payloads (ids, nonces, limits, version),
            bound into the keys and the proofs so that a relay cannot alter any of them.

    Attributes:
        proof_key: keys the HMAC proofs of the handshake.
        client_to_server, server_to_client: the ChaCha20 keys of each direction.
    """

    def __init__(self, secret: bytes, client_nonce: bytes, server_nonce: bytes,
                 transcript: bytes) -> None:
        okm = HKDF(algorithm=hashes.SHA256(), length=3 * KEY_BYTES,
                   salt=client_nonce + server_nonce,
                   info=_INFO + hashlib.sha256(transcript).digest()).derive(secret)
        self.proof_key = okm[:KEY_BYTES]
        self.client_to_server = okm[KEY_BYTES : 2 * KEY_BYTES]
        self.server_to_client = okm[2 * KEY_BYTES :]


class BlockTags:
    """The tags of a snapshot's payload blocks, made once when the snapshot is sealed.

    A push then sends each block with its tag already made (protocol v4's pretagged DATA,
    :mod:`elasticd.replication.wire`): the pass over the bytes that authenticates them is paid
    once per snapshot, on the daemon's seal thread, instead of on every push's critical path,
    where it bounded the sender at 0.6x a raw socket. The receiver still checks every block.

    The key of one snapshot is HKDF over the cluster secret salted with :attr:`salt` (16
    random bytes drawn at seal time and sent in PUT_BEGIN), so that only holders of the secret
    can make or check a tag, and no two snapshots share a key; a block's tag is the
    ChaCha20-Poly1305 tag (empty plaintext, the block as associated data) under that key with
    the block's byte offset as nonce, so a block moved to another offset fails too.

    Attributes:
        tags: ``{offset: (length, tag)}``, one per block.
    """

    def __init__(self, salt: bytes, tags: dict[int, tuple[int, bytes]]) -> None:
        self.salt, self.tags = salt, tags

    def tag_at(self, offset: int, length: int) -> bytes | None:
        """The tag made for exactly the bytes ``[offset, offset + length)``, if any."""
        found = self.tags.get(offset)
        return found[1] if found is not None and found[0] == length else None


class BlockTagger:
    """Makes and checks :class:`BlockTags` under the cluster secret."""

    def __init__(self, secret: bytes) -> None:
        self._secret = bytes(secret)

    def key(self, salt: bytes) -> bytes:
        if len(salt) != SALT_BYTES:
            raise ValueError(f"block tag salt must be {SALT_BYTES} bytes, got {len(salt)}")
        return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt,
                    info=_BLOCK_INFO).derive(self._secret)

    def tag(self, buf: Any, ranges: Iterable[tuple[int, int]], base: int = 0) -> BlockTags:
        """Tags the blocks ``[start, end)`` of a snapshot under a fresh salt.

        Args:
            buf: the snapshot's bytes from offset ``base`` on.
            ranges: the blocks, as offsets in the snapshot (the pushes' DATA offsets).
        """
        view = memoryview(buf).cast("B")
        salt = os.urandom(SALT_BYTES)
        key = self.key(salt)
        tags = {}
        for start, end in ranges:
            tagger = one_time_tagger(key, start)
            tagger.update(view[start - base : end - base])
            tags[start] = (end - start, tagger.tag())
        return BlockTags(salt, tags)
