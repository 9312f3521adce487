"""The replication protocol's typed frames: one dataclass per frame type, and whole-frame
encoding and decoding.

Each message knows its :class:`~elasticd.replication.wire.FrameType`, builds its payload and
parses one, raising only :class:`~elasticd.replication.wire.ProtocolError` subclasses on bad
input. DATA frames are the exception on the hot path: :func:`data_prefix` builds only their
header and offset so the chunk itself is sent (and received, by the channel) where it lies.
Given the direction's :class:`~elasticd.replication.seal.FrameKey`, both seal the frame (a
ChaCha20-Poly1305 tag in place of the checksum); without one (the handshake) they checksum it.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any, ClassVar, Sequence, Union, get_args

from elasticd.replication.api import Descriptor
from elasticd.replication.seal import SALT_BYTES, TAG_BYTES, FrameKey
from elasticd.replication.wire import (
    CHECKED,
    FLAG_PRETAGGED,
    FLAG_SEALED,
    MAGIC,
    MAX_NODE_ID,
    NONCE_BYTES,
    OFFSET,
    MAX_RUN_BLOCKS,
    RUN,
    RUN_ENTRY,
    PROOF_BYTES,
    VERSION,
    FrameHeader,
    FrameType,
    MalformedFrame,
    ForgedFrame,
    UnsealedFrame,
    checksum,
    verify,
)
from elasticd.snapshot.format import JOB_RE


def _node_id(raw: bytes) -> str:
    try:
        value = raw.decode()
    except UnicodeDecodeError as exc:
        raise MalformedFrame("node id is not UTF-8") from exc
    if not value or not value.isprintable():
        raise MalformedFrame(f"invalid node id {value!r:.80}")
    return value


def _encode_node_id(node_id: str) -> bytes:
    raw = node_id.encode()
    if not 0 < len(raw) <= MAX_NODE_ID or not node_id.isprintable():
        raise ValueError(f"node id must be 1..{MAX_NODE_ID} printable bytes, got {node_id!r:.80}")
    return raw


def _exact(value: bytes, size: int) -> bytes:
    if len(value) != size:
        raise ValueError(f"expected {size} bytes, got {len(value)}")
    return bytes(value)


def _json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _object(payload: bytes | memoryview, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(bytes(payload))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise MalformedFrame(f"{what} payload is not JSON ({exc.__class__.__name__})") from exc
    if not isinstance(obj, dict):
        raise MalformedFrame(f"{what} payload is not a JSON object")
    return obj


def _str_field(obj: dict[str, Any], name: str, what: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        raise MalformedFrame(f"{what}: {name} must be a string, got {value!r:.80}")
    return value


def _descriptor(obj: dict[str, Any], what: str) -> Descriptor:
    fields = ("job", "owner_rank", "generation", "step", "total_bytes", "header_bytes")
    try:
        return Descriptor(**{f: obj[f] for f in fields})
    except (KeyError, TypeError, ValueError) as exc:
        raise MalformedFrame(f"{what}: invalid descriptor ({exc})") from exc


def _with_salt(d: Descriptor, salt: bytes | None) -> bytes:
    """A descriptor's JSON, with the block tags' salt when there is one."""
    obj: dict[str, Any] = dataclasses.asdict(d)
    if salt is not None:
        obj["tag_salt"] = _exact(salt, SALT_BYTES).hex()
    return _json(obj)


def _salt(obj: dict[str, Any], what: str) -> bytes | None:
    salt = obj.get("tag_salt")
    if salt is None:
        return None
    try:
        return _exact(bytes.fromhex(salt), SALT_BYTES)
    except (TypeError, ValueError) as exc:
        raise MalformedFrame(f"{what}: invalid tag_salt ({exc})") from exc


_GREETING = struct.Struct(f"!{NONCE_BYTES}sIH")
_PUT_END = struct.Struct("!QI")


@dataclasses.dataclass(frozen=True)
class _Greeting:
    """A HELLO or CHALLENGE: who the sender is, its fresh nonce, the largest DATA frame it
    accepts."""

    TYPE: ClassVar[FrameType]
    node_id: str
    nonce: bytes
    max_frame: int

    def payload(self) -> bytes:
        raw = _encode_node_id(self.node_id)
        return _GREETING.pack(_exact(self.nonce, NONCE_BYTES), self.max_frame, len(raw)) + raw

    @classmethod
    def parse(cls, p: memoryview) -> Any:
        what = cls.TYPE.name
        if len(p) < _GREETING.size:
            raise MalformedFrame(f"{what} payload of {len(p)} bytes is too short")
        nonce, max_frame, n = _GREETING.unpack_from(p)
        if len(p) != _GREETING.size + n:
            raise MalformedFrame(f"{what} node id length does not match the payload")
        # The peer sizes its DATA chunks from this: it must leave room for the offset and data.
        if max_frame <= OFFSET.size:
            raise MalformedFrame(f"{what} announces a DATA frame limit of {max_frame} bytes")
        return cls(_node_id(bytes(p[_GREETING.size:])), nonce, max_frame)


_SCOPE = struct.Struct("!H")


@dataclasses.dataclass(frozen=True)
class Hello(_Greeting):
    """Client's opening; ``scope``, when given, asks for a session scoped to that job: the
    server answers FETCH of that job on it and nothing else (``REPORT``, ``PUT_BEGIN`` and
    other jobs' fetches end the connection). A session a daemon can hand to its job's worker
    (issue 30's design, bench/results/restore40/). The scope follows the node id, its length
    first; a HELLO without one is the one every version sends, so unscoped sessions are
    unchanged. The HELLO is part of the handshake's transcript: nobody on the path can drop
    or change the scope."""

    TYPE: ClassVar[FrameType] = FrameType.HELLO
    scope: str | None = None

    def payload(self) -> bytes:
        base = super().payload()
        if self.scope is None:
            return base
        if not isinstance(self.scope, str) or not JOB_RE.fullmatch(self.scope):
            raise ValueError(f"a session's scope must be a job name, got {self.scope!r:.80}")
        raw = self.scope.encode()
        return base + _SCOPE.pack(len(raw)) + raw

    @classmethod
    def parse(cls, p: memoryview) -> "Hello":
        if len(p) < _GREETING.size:
            raise MalformedFrame(f"HELLO payload of {len(p)} bytes is too short")
        end = _GREETING.size + _GREETING.unpack_from(p)[2]
        if len(p) <= end:
            return super().parse(p)
        greeting = super().parse(p[:end])
        if len(p) < end + _SCOPE.size or len(p) != end + _SCOPE.size + _SCOPE.unpack_from(
                p, end)[0]:
            raise MalformedFrame("HELLO scope length does not match the payload")
        try:
            scope = bytes(p[end + _SCOPE.size :]).decode()
        except UnicodeDecodeError as exc:
            raise MalformedFrame("HELLO scope is not UTF-8") from exc
        if not JOB_RE.fullmatch(scope):
            raise MalformedFrame(f"HELLO scope {scope!r:.80} is not a job name")
        return cls(greeting.node_id, greeting.nonce, greeting.max_frame, scope)


@dataclasses.dataclass(frozen=True)
class Challenge(_Greeting):
    """Server's answer.

    Nothing in it depends on the cluster secret: the server proves itself only after the
    client has (its first sealed frame), so a caller without the secret learns nothing to test
    guesses against.
    """

    TYPE: ClassVar[FrameType] = FrameType.CHALLENGE


@dataclasses.dataclass(frozen=True)
class Auth:
    """Client's proof."""

    TYPE: ClassVar[FrameType] = FrameType.AUTH
    proof: bytes

    def payload(self) -> bytes:
        return _exact(self.proof, PROOF_BYTES)

    @classmethod
    def parse(cls, p: memoryview) -> "Auth":
        if len(p) != PROOF_BYTES:
            raise MalformedFrame(f"AUTH payload must be {PROOF_BYTES} bytes, got {len(p)}")
        return cls(bytes(p))


@dataclasses.dataclass(frozen=True)
class _Described:
    """A frame naming a snapshot, and the salt of its block tags when its DATA comes
    pretagged."""

    TYPE: ClassVar[FrameType]
    descriptor: Descriptor
    tag_salt: bytes | None = None

    def payload(self) -> bytes:
        return _with_salt(self.descriptor, self.tag_salt)

    @classmethod
    def parse(cls, p: memoryview) -> Any:
        obj = _object(p, cls.TYPE.name)
        return cls(_descriptor(obj, cls.TYPE.name), _salt(obj, cls.TYPE.name))


@dataclasses.dataclass(frozen=True)
class PutBegin(_Described):
    """Announces a push; ``tag_salt`` when (some of) its DATA frames come pretagged."""

    TYPE: ClassVar[FrameType] = FrameType.PUT_BEGIN


@dataclasses.dataclass(frozen=True)
class Data:
    """A chunk at ``offset`` of the snapshot's bytes (streamed by :mod:`channel`, not built)."""

    TYPE: ClassVar[FrameType] = FrameType.DATA
    offset: int
    chunk: memoryview

    @classmethod
    def parse(cls, p: memoryview) -> "Data":
        if len(p) <= OFFSET.size:
            raise MalformedFrame(f"DATA payload of {len(p)} bytes has no room for offset and data")
        return cls(OFFSET.unpack_from(p)[0], p[OFFSET.size:])


@dataclasses.dataclass(frozen=True)
class PutEnd:
    """End of a snapshot's DATA frames: how many bytes and frames were sent."""

    TYPE: ClassVar[FrameType] = FrameType.PUT_END
    total_bytes: int
    frames: int

    def payload(self) -> bytes:
        return _PUT_END.pack(self.total_bytes, self.frames)

    @classmethod
    def parse(cls, p: memoryview) -> "PutEnd":
        if len(p) != _PUT_END.size:
            raise MalformedFrame(f"PUT_END payload must be {_PUT_END.size} bytes, got {len(p)}")
        return cls(*_PUT_END.unpack(p))


@dataclasses.dataclass(frozen=True)
class Ack:
    TYPE: ClassVar[FrameType] = FrameType.ACK
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def payload(self) -> bytes:
        return _json(self.info)

    @classmethod
    def parse(cls, p: memoryview) -> "Ack":
        return cls(_object(p, "ACK"))


@dataclasses.dataclass(frozen=True)
class Nack:
    """A refusal that leaves the connection usable (e.g. ``stale``)."""

    TYPE: ClassVar[FrameType] = FrameType.NACK
    reason: str
    message: str = ""

    def payload(self) -> bytes:
        return _json({"reason": self.reason, "message": self.message})

    @classmethod
    def parse(cls, p: memoryview) -> "Nack":
        obj = _object(p, "NACK")
        return cls(_str_field(obj, "reason", "NACK"), _str_field(obj, "message", "NACK"))


#: The most byte ranges one FETCH may ask for (v7): a striped restore asks for a piece's runs of
#: wanted blocks in one request, tens at most; the bound keeps the request a small frame.
MAX_FETCH_RANGES = 1024


@dataclasses.dataclass(frozen=True)
class Fetch:
    """Asks for a committed copy; ``generation``/``step`` both None means the newest.

    ``offset``/``length`` (both or neither) ask for only the bytes ``[offset, offset +
    length)`` of the snapshot, sent as DATA at their snapshot offsets: a client striping one
    snapshot across several holders asks each for a range. A zero length asks for the
    descriptor alone. Neither means the whole snapshot. ``ranges`` (v7, instead of
    ``offset``/``length``) asks for several: ``(offset, length)`` pairs, each non-empty, in
    ascending order with a gap between each and the next, sent in that order in one stream
    (a piece of a partial restore is several runs of wanted blocks, where one request each
    cost a round trip and ~0.7 ms of a holder's CPU: bench/results/restore32/).
    """

    TYPE: ClassVar[FrameType] = FrameType.FETCH
    job: str
    owner_rank: int
    generation: int | None = None
    step: int | None = None
    offset: int | None = None
    length: int | None = None
    ranges: tuple[tuple[int, int], ...] | None = None

    def payload(self) -> bytes:
        obj = dataclasses.asdict(self)
        if self.offset is None and self.length is None:
            del obj["offset"], obj["length"]  # the whole snapshot: no range keys
        if self.ranges is None:
            del obj["ranges"]
        return _json(obj)

    @classmethod
    def parse(cls, p: memoryview) -> "Fetch":
        obj = _object(p, "FETCH")
        job = _str_field(obj, "job", "FETCH")
        rank, gen, step = obj.get("owner_rank"), obj.get("generation"), obj.get("step")
        offset, length = obj.get("offset"), obj.get("length")
        ints = [v for v in (rank, gen, step, offset, length) if v is not None]
        if (rank is None or (gen is None) != (step is None) or (offset is None) != (length is None)
                or any(not _uint(v) for v in ints)):
            raise MalformedFrame("FETCH needs owner_rank, either both or neither of generation "
                                 "and step, and either both or neither of offset and length, "
                                 "as integers >= 0")
        ranges = obj.get("ranges")
        if ranges is not None:
            ranges = _ranges(ranges)
            if offset is not None:
                raise MalformedFrame("FETCH asks for offset and length or for ranges, not both")
        return cls(job, rank, gen, step, offset, length, ranges)

    def byte_ranges(self, total: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` ranges asked for in a snapshot of ``total`` bytes, in order.

        Raises:
            ValueError: a range does not lie within the snapshot.
        """
        if self.ranges is None:
            return [self.byte_range(total)]
        end = self.ranges[-1][0] + self.ranges[-1][1]
        if end > total:
            raise ValueError(f"bytes [{self.ranges[-1][0]}, {end}) lie outside the snapshot of "
                             f"{total} bytes")
        return [(o, o + n) for o, n in self.ranges]

    def byte_range(self, total: int) -> tuple[int, int]:
        """``[start, end)`` asked for in a snapshot of ``total`` bytes (one range or none).

        Raises:
            ValueError: the range does not lie within the snapshot.
        """
        if self.offset is None or self.length is None:
            return 0, total
        if self.offset + self.length > total:
            raise ValueError(f"bytes [{self.offset}, {self.offset + self.length}) lie outside "
                             f"the snapshot of {total} bytes")
        return self.offset, self.offset + self.length


def joined_ranges(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``(offset, length)`` ranges as a FETCH asks for them: adjacent ones joined, empty ones
    left out.

    Raises:
        ValueError: none left, more than MAX_FETCH_RANGES, a negative figure, or ranges out of
            order or overlapping.
    """
    out: list[tuple[int, int]] = []
    for offset, length in ranges:
        if offset < 0 or length < 0:
            raise ValueError(f"byte range (offset, length) must be >= 0, got {(offset, length)}")
        if not length:
            continue
        if out and offset < out[-1][0] + out[-1][1]:
            raise ValueError(f"byte ranges must ascend without overlapping: {(offset, length)} "
                             f"after {out[-1]}")
        if out and offset == out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((offset, length))
    if not 0 < len(out) <= MAX_FETCH_RANGES:
        raise ValueError(f"a fetch asks for 1 to {MAX_FETCH_RANGES} non-empty byte ranges, "
                         f"got {len(out)}")
    return tuple(out)


def _uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _ranges(raw: Any) -> tuple[tuple[int, int], ...]:
    """A FETCH's ``ranges``, checked: 1 to MAX_FETCH_RANGES ``[offset, length]`` pairs of
    integers, each non-empty, ascending, none touching the next."""
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_FETCH_RANGES:
        raise MalformedFrame(f"FETCH ranges must be a list of 1 to {MAX_FETCH_RANGES} "
                             "[offset, length] pairs")
    out, end = [], -1
    for pair in raw:
        if (not isinstance(pair, list) or len(pair) != 2 or not all(_uint(v) for v in pair)
                or pair[1] == 0 or pair[0] <= end):
            raise MalformedFrame("FETCH ranges must be [offset, length] pairs of integers >= 0, "
                                 "each non-empty and after a gap from the one before: got "
                                 f"{pair!r:.60}")
        out.append((pair[0], pair[1]))
        end = pair[0] + pair[1]
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class FetchReply(_Described):
    """The held copy a FETCH is served from; ``tag_salt`` when the holder kept its block tags
    (v5): the blocks of the range then come pretagged, checked by the receiver alone."""

    TYPE: ClassVar[FrameType] = FrameType.FETCH_REPLY


@dataclasses.dataclass(frozen=True)
class Error:
    """The sender is closing the connection because of ``code``."""

    TYPE: ClassVar[FrameType] = FrameType.ERROR
    code: str
    message: str = ""

    def payload(self) -> bytes:
        return _json({"code": self.code, "message": self.message[:1000]})

    @classmethod
    def parse(cls, p: memoryview) -> "Error":
        obj = _object(p, "ERROR")
        return cls(_str_field(obj, "code", "ERROR"), _str_field(obj, "message", "ERROR"))


@dataclasses.dataclass(frozen=True)
class _Opaque:
    """A frame whose payload is a body another module encodes and decodes."""

    body: bytes

    def payload(self) -> bytes:
        return self.body

    @classmethod
    def parse(cls, p: memoryview) -> "_Opaque":
        return cls(bytes(p))


@dataclasses.dataclass(frozen=True)
class CommitReport(_Opaque):
    """A node's commit report to its job's coordinator (:mod:`elasticd.replication.report`
    decodes ``body``)."""

    TYPE: ClassVar[FrameType] = FrameType.REPORT


@dataclasses.dataclass(frozen=True)
class CommitReply(_Opaque):
    """The coordinator's answer to a :class:`CommitReport`."""

    TYPE: ClassVar[FrameType] = FrameType.REPORT_REPLY


Message = Union[Hello, Challenge, Auth, PutBegin, Data, PutEnd, Ack, Nack, Fetch, FetchReply,
                Error, CommitReport, CommitReply]
MESSAGES: dict[FrameType, Any] = {cls.TYPE: cls for cls in get_args(Message)}


def _check(ftype: FrameType, size: int, key: FrameKey | None, *parts: Any) -> bytes:
    """The 12 covered header bytes and the check: sealed under ``key``, else a checksum."""
    checked = CHECKED.pack(MAGIC, VERSION, ftype, FLAG_SEALED if key else 0, size)
    return checked + (key.seal(checked, *parts) if key else checksum(checked, *parts))


def encode_frame(msg: Message, key: FrameKey | None = None) -> bytes:
    """Header plus payload of ``msg``, ready to send (sealed as the next frame of ``key``)."""
    payload = msg.payload()
    return _check(msg.TYPE, len(payload), key, payload) + payload


def data_prefix(offset: int, chunk: Any, key: FrameKey | None = None) -> bytes:
    """Header and offset of a DATA frame carrying ``chunk``; send the chunk right after it.

    Built apart from the chunk so that the chunk is sent from where it lies, uncopied (the tag
    reads it there too).
    """
    off = OFFSET.pack(offset)
    return _check(FrameType.DATA, OFFSET.size + memoryview(chunk).nbytes, key, off, chunk) + off


def run_prefix(offset: int, blocks: Sequence[tuple[int, bytes]], key: FrameKey) -> bytes:
    """Header, session tag and run prefix of a pretagged DATA frame carrying ``blocks``.

    Args:
        offset: the snapshot offset of the first block; the others follow it back to back.
        blocks: ``(length, block tag)`` of each block, in order (1 to MAX_RUN_BLOCKS).

    The session tag covers only these bytes: each block is covered by its block tag, made when
    the snapshot was sealed (wire.py), so nothing here reads the blocks.
    """
    if not 0 < len(blocks) <= MAX_RUN_BLOCKS:
        raise ValueError(f"a run carries 1 to {MAX_RUN_BLOCKS} blocks, got {len(blocks)}")
    prefix = RUN.pack(offset, len(blocks)) + b"".join(
        RUN_ENTRY.pack(length, _exact(tag, TAG_BYTES)) for length, tag in blocks)
    checked = CHECKED.pack(MAGIC, VERSION, FrameType.DATA, FLAG_SEALED | FLAG_PRETAGGED,
                           len(prefix) + sum(length for length, _ in blocks))
    return checked + key.seal(checked, prefix) + prefix


def decode_payload(header: FrameHeader, payload: memoryview) -> Message:
    return MESSAGES[header.type].parse(payload)


def open_payload(header: FrameHeader, key: FrameKey | None, *parts: Any) -> None:
    """Checks a whole frame's payload: its tag under ``key`` when sealed, else its checksum.

    Raises:
        UnsealedFrame: sealed without a key, or unsealed where a key is in force.
        ForgedFrame, ChecksumMismatch: the bytes are not what was sent.
    """
    opener = frame_opener(header, key)
    if opener is None:
        verify(header, *parts)
        return
    for part in parts:
        opener.update(part)
    opener.check(header)


def frame_opener(header: FrameHeader, key: FrameKey | None) -> "FrameCheck | None":
    """Starts checking a sealed frame (None for an unsealed one, checked by its checksum)."""
    if header.sealed != (key is not None):
        raise UnsealedFrame(
            f"{header.type.name} frame without a tag after the handshake" if key else
            f"{header.type.name} frame sealed before any session key exists")
    return FrameCheck(key.opener(header.check), header.checked) if key is not None else None


class FrameCheck:
    """The tag check of one sealed frame, fed its payload as it arrives."""

    def __init__(self, opener: Any, checked: bytes) -> None:
        self._opener = opener
        opener.update(checked)
        self.update = opener.update

    def check(self, header: FrameHeader, where: str = "") -> None:
        if not self._opener.verify():
            raise ForgedFrame(f"{header.type.name} frame of {header.length} bytes{where} fails "
                              "its authentication tag: altered, replayed or reordered in "
                              "transit, or not sent by the authenticated peer")
