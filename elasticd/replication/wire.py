"""The replication protocol's framing: a fixed binary header in front of every payload.

Every frame starts with a 28-byte header, network byte order::

    magic "EDRP" (4) | version u8 | type u8 | flags u16 | payload length u32 | check (16)

The check covers the first 12 header bytes followed by the payload, so a flipped type or length
is caught as surely as a flipped payload byte: SEALED (every frame after the handshake), the
frame's session tag (:mod:`elasticd.replication.seal`); unsealed (the handshake only, before
any key exists), xxh3_128, which detects corruption (the handshake's content is bound by the
keys and proofs derived from it).

A sealed DATA frame may also be PRETAGGED (v6): a run of consecutive blocks, each with the tag
made when the snapshot was sealed (:class:`~elasticd.replication.seal.BlockTags`), the session
tag covering the header and the prefix only; docs/replication.md ("Transport") says why and what
each tag stops. Its payload is::

    offset u64 | n u32 | n × (length u32 | block tag (16)) | the n blocks, back to back

A reader checks magic, version, type, flags and the length limit for that type *before* reading
the payload, so a hostile or corrupt length never makes it allocate or wait for more than
:class:`Limits` allows. Payloads are binary (``struct``) where they carry nonces or offsets and
small JSON objects elsewhere (:mod:`elasticd.replication.messages`); never pickle.

The frames, by conversation (``C`` client, ``S`` server):

* handshake: C HELLO → S CHALLENGE → C AUTH → S ACK, sealed (or ERROR unsealed, and close);
* push: C PUT_BEGIN → S ACK | NACK, then C DATA… PUT_END → S ACK | NACK;
* fetch: C FETCH → S FETCH_REPLY, DATA…, PUT_END | NACK (FETCH_REPLY carries the salt of the
  held copy's block tags when it has them: its DATA frames then come pretagged, as a push's);
* commit report (v5): C REPORT → S REPORT_REPLY (the server is the job's commit coordinator);
* ERROR from either side ends the connection.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Any

import xxhash

from elasticd.replication.api import ReplicationError

MAGIC = b"EDRP"
VERSION = 7  # 2: client proves first, frames sealed (AES-GMAC); 3: tags are ChaCha20-Poly1305;
# 4: pretagged DATA (block tags made at seal time); 5: commit reports to the job's coordinator
# (REPORT, REPORT_REPLY), which replaced the per-node replicated records in etcd; holders keep
# the block tags a push brought and serve fetches pretagged (FETCH_REPLY carries the salt);
# 6: a pretagged DATA frame carries a run of blocks (RUN, RUN_ENTRY), not one; 7: a FETCH
# may ask for several byte ranges in one request (``ranges``)
#: What a peer speaking an older version is told to do (the log line on each side).
UPGRADE = ("upgrade elasticd on every node of the cluster (docs/operations.md, section 8, "
           "\"Upgrades\"): this release asks for several ranges in one fetch (replication "
           "protocol v7) and cannot replicate with older nodes")
CHECK_BYTES = 16
HEADER = struct.Struct(f"!4sBBHI{CHECK_BYTES}s")
HEADER_SIZE = HEADER.size
CHECKED = struct.Struct("!4sBBHI")  # the header bytes the checksum covers
OFFSET = struct.Struct("!Q")
FLAG_SEALED = 0x0001  # the check is the session's Poly1305 tag, not a checksum
FLAG_PRETAGGED = 0x0002  # DATA only: the chunk carries its own block tag (see PRETAG)
KNOWN_FLAGS = FLAG_SEALED | FLAG_PRETAGGED  # any other set bit means a newer peer
RUN = struct.Struct("!QI")  # a pretagged DATA frame's first offset and block count
RUN_ENTRY = struct.Struct("!I16s")  # then each block's length and tag
#: Most blocks one run may carry: bounds the prefix a reader buffers and checks before any block.
MAX_RUN_BLOCKS = 64
MAX_RUN_PREFIX = RUN.size + MAX_RUN_BLOCKS * RUN_ENTRY.size
NONCE_BYTES = 32
PROOF_BYTES = 32
MAX_NODE_ID = 255
DEFAULT_MAX_FRAME = 8 << 20
DEFAULT_MAX_CONTROL = 64 << 10
MAX_FRAME_LIMIT = 2**32 - 1


class ProtocolError(ReplicationError):
    """The peer sent something this protocol does not allow."""


class BadMagic(ProtocolError):
    """The bytes do not start an elasticd replication frame."""


class UnsupportedVersion(ProtocolError):
    """The peer speaks another protocol version."""


class UnknownFrameType(ProtocolError):
    """The frame type is not one this version defines."""


class UnknownFlags(ProtocolError):
    """Flag bits this version does not define are set."""


class FrameTooLarge(ProtocolError):
    """A length field exceeds the configured limit for that frame type."""


class ChecksumMismatch(ProtocolError):
    """The frame's bytes do not match its checksum (corrupted in transit or in memory)."""


class TruncatedFrame(ProtocolError):
    """Fewer bytes than the frame needs (a buffer cut short, or a connection closed mid-frame)."""


class ForgedFrame(ProtocolError):
    """A sealed frame fails its tag: altered, replayed, reordered, or not from the peer."""


class BlockTagMismatch(ForgedFrame):
    """A pretagged block fails its block tag: the bytes are not the ones its owner sealed
    (corrupted in the sender's memory, or altered in transit)."""


class UnsealedFrame(ProtocolError):
    """A frame without a tag where the session requires one, or with one before keys exist."""


class MalformedFrame(ProtocolError):
    """The payload does not decode as the frame type says."""


class ScopeViolation(ProtocolError):
    """A session scoped to one job asked for something else (another job's copy, a push, a
    report)."""


class UnexpectedFrame(ProtocolError):
    """A valid frame that is not allowed at this point of the conversation."""


class FrameType(enum.IntEnum):
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    PUT_BEGIN = 4
    DATA = 5
    PUT_END = 6
    ACK = 7
    NACK = 8
    FETCH = 9
    FETCH_REPLY = 10
    ERROR = 11
    REPORT = 12
    REPORT_REPLY = 13


@dataclasses.dataclass(frozen=True)
class Limits:
    """Largest payloads a reader accepts.

    Attributes:
        max_frame: largest DATA payload (8-byte offset plus chunk).
        max_control: largest payload of any other frame.
    """

    max_frame: int = DEFAULT_MAX_FRAME
    max_control: int = DEFAULT_MAX_CONTROL

    def __post_init__(self) -> None:
        if not OFFSET.size < self.max_frame <= MAX_FRAME_LIMIT:
            raise ValueError(f"max_frame must be in ({OFFSET.size}, {MAX_FRAME_LIMIT}], "
                             f"got {self.max_frame}")
        if not 256 <= self.max_control <= self.max_frame:
            raise ValueError(f"max_control must be in [256, max_frame], got {self.max_control}")


@dataclasses.dataclass(frozen=True)
class FrameHeader:
    type: FrameType
    flags: int
    length: int
    check: bytes  # checksum (unsealed) or tag (sealed)
    checked: bytes  # the 12 header bytes under the check

    @property
    def sealed(self) -> bool:
        return bool(self.flags & FLAG_SEALED)

    @property
    def pretagged(self) -> bool:
        return bool(self.flags & FLAG_PRETAGGED)


def parse_header(raw: bytes | bytearray | memoryview, limits: Limits) -> FrameHeader:
    """Validates a frame header before any of its payload is read.

    Raises:
        ProtocolError: bad magic, version, type or flags; a length over the limit.
    """
    if len(raw) != HEADER_SIZE:
        raise TruncatedFrame(f"frame header is {HEADER_SIZE} bytes, got {len(raw)}")
    magic, version, ftype, flags, length, check = HEADER.unpack(raw)
    if magic != MAGIC:
        raise BadMagic(f"frame starts with {magic!r}, expected {MAGIC!r}: not an elasticd "
                       "replication peer, or the stream lost its framing")
    if version != VERSION:
        raise UnsupportedVersion(f"peer speaks replication protocol v{version}, this elasticd "
                                 f"speaks v{VERSION}: {UPGRADE}")
    try:
        kind = FrameType(ftype)
    except ValueError as exc:
        raise UnknownFrameType(f"unknown frame type {ftype} in protocol v{VERSION}") from exc
    if flags & ~KNOWN_FLAGS:
        raise UnknownFlags(f"{kind.name} frame has undefined flag bits {flags:#06x}")
    limit = limits.max_frame if kind is FrameType.DATA else limits.max_control
    if length > limit:
        raise FrameTooLarge(f"{kind.name} frame announces {length} payload bytes, limit {limit}")
    if kind is FrameType.DATA and length <= OFFSET.size:
        raise MalformedFrame(f"DATA frame of {length} bytes has no room for offset and data")
    if flags & FLAG_PRETAGGED:
        if kind is not FrameType.DATA or not flags & FLAG_SEALED:
            raise UnknownFlags(f"{kind.name} frame is marked pretagged, which only a sealed "
                               "DATA frame may be")
        if length <= RUN.size + RUN_ENTRY.size:
            raise MalformedFrame(f"pretagged DATA frame of {length} bytes has no room for "
                                 "a run of blocks")
    return FrameHeader(kind, flags, length, check, bytes(raw[: CHECKED.size]))


def checksum(checked: bytes, *parts: Any) -> bytes:
    """xxh3_128 over the covered header bytes then the payload parts (unsealed frames)."""
    h = xxhash.xxh3_128(checked)
    for part in parts:
        h.update(part)
    return h.digest()


def verify(header: FrameHeader, *parts: Any) -> None:
    """Raises :class:`ChecksumMismatch` unless ``parts`` are the payload ``header`` announced.

    For unsealed frames only; sealed ones are opened with their session key (the channel).
    """
    if checksum(header.checked, *parts) != header.check:
        raise ChecksumMismatch(f"{header.type.name} frame of {header.length} bytes fails its "
                               "xxh3 checksum")
