"""Versioned records stored in etcd.

Every value elasticd writes is a JSON object with a schema version ``schema`` and a record type
``record``, beside the record's own fields. A reader refuses, with a clear error, a record it
cannot read: not JSON (corrupt), the wrong kind, or a newer schema than it knows (written by a
newer elasticd: upgrade this node). JSON and not pickle: nothing read from etcd may run code.

Whoever can write to etcd is not trusted to write well-formed records (docs/security.md): a
dataclass record is checked field by field against its annotations on decode (an ``int`` is a
JSON integer and not a boolean, a ``float`` a finite number, a ``str`` a string, lists and
dicts of those), and ``NaN``/``Infinity`` are refused anywhere in a record, so a malformed
record is a :class:`CorruptRecord` at the edge rather than a ``TypeError`` deep in a decision.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import threading
import types
import typing
from typing import Any, Type, TypeVar

from elasticd.errors import InputError

SCHEMA_VERSION = 1


#: A record field's closed set of values (job and drain states): each member is its string in
#: JSON, comparisons and formatting, so records read and print as when they were plain strings.
ValueEnum = enum.StrEnum


class RecordError(InputError, ValueError):
    """A stored record could not be read."""


class CorruptRecord(RecordError):
    """The bytes are not a record of the expected kind."""


class UnsupportedRecordVersion(RecordError):
    """The record was written with a newer schema than this elasticd understands."""


class Complaints:
    """Logs each unreadable record once, however often it is read again.

    A daemon re-reads the same keys every cycle or resync; a bad record should cost one
    warning, not one per read, yet a new bad value under the same key is news. Remembers up to
    ``limit`` (key, value) pairs, forgetting the oldest first.
    """

    def __init__(self, logger: Any, limit: int = 20_000) -> None:
        self._log = logger
        self._lock = threading.Lock()  # watch callbacks and worker threads report too
        self._seen: dict[tuple[bytes, int], None] = {}
        self.limit = limit

    def warn(self, key: bytes | str, value: bytes, message: str, *args: Any) -> bool:
        """Logs ``message % args`` at WARNING unless this (key, value) was already reported
        (then returns False)."""
        ident = (key if isinstance(key, bytes) else key.encode(), hash(value))
        with self._lock:
            if ident in self._seen:
                return False
            self._seen[ident] = None
            if len(self._seen) > self.limit:
                del self._seen[next(iter(self._seen))]
        self._log.warning(message, *args)
        return True


R = TypeVar("R")


_ENVELOPE = ("schema", "record")


def encode(kind: str, payload: dict[str, Any], schema: int | None = None) -> bytes:
    """The record's bytes; ``schema``: a kind's own newer layout (default
    :data:`SCHEMA_VERSION`), which an older elasticd refuses to read with a message naming the
    upgrade."""
    clash = [k for k in _ENVELOPE if k in payload]
    if clash:
        raise ValueError(f"record fields {clash} are reserved for the envelope")
    body = {"schema": schema or SCHEMA_VERSION, "record": kind, **payload}
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def loads(raw: bytes | str) -> Any:
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and ``-Infinity`` (Python's json
    accepts them; no elasticd record holds one, and a NaN compares false with everything)."""
    return json.loads(raw, parse_constant=_no_constant)


def where_of(key: bytes | str) -> str:
    """The key as text, for error messages."""
    return key.decode(errors="replace") if isinstance(key, bytes) else key


def decode(raw: bytes, kind: str, key: bytes | str = b"?",
           schema: int | None = None) -> dict[str, Any]:
    """Returns the payload of a record of ``kind`` (without the envelope); with ``schema``,
    the kind's newest layout this elasticd reads (its ``"schema"`` stays in the payload then,
    so that the caller reads each layout its own way).

    Raises:
        CorruptRecord: not JSON, not an object, or another kind.
        UnsupportedRecordVersion: a schema newer than :data:`SCHEMA_VERSION` (or ``schema``).
    """
    newest = schema or SCHEMA_VERSION
    where = where_of(key)
    try:
        body = loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptRecord(f"{where}: not a valid record ({exc.__class__.__name__}: {exc})") from exc
    if not isinstance(body, dict) or type(body.get("schema")) is not int:
        raise CorruptRecord(f"{where}: not a versioned elasticd record")
    if body["schema"] > newest:
        raise UnsupportedRecordVersion(
            f"{where}: written with record schema v{body['schema']}, this elasticd reads up to "
            f"v{newest}; upgrade elasticd on this node"
        )
    if body.get("record") != kind:
        raise CorruptRecord(f"{where}: expected a {kind!r} record, found {body.get('record')!r}")
    for k in _ENVELOPE if schema is None else ("record",):
        body.pop(k)
    return body


def encode_dataclass(kind: str, obj: Any) -> bytes:
    return encode(kind, dataclasses.asdict(obj))


def decode_dataclass(cls: Type[R], raw: bytes, kind: str, key: bytes | str = b"?") -> R:
    """Decodes into ``cls``, ignoring unknown fields (added by a newer minor writer) and
    rejecting missing required ones and values of the wrong type.

    Raises:
        CorruptRecord: not a record of ``kind``, a field missing or of the wrong type.
        UnsupportedRecordVersion: a schema newer than :data:`SCHEMA_VERSION`.
    """
    return from_payload(cls, decode(raw, kind, key), where_of(key), f" of the {kind!r} record")


def from_payload(cls: Type[R], payload: dict[str, Any], where: str, what: str = "") -> R:
    """``cls`` from a record's decoded payload, as :func:`decode_dataclass` checks it
    (``what`` follows "field" and "incomplete" in its errors). Raises: CorruptRecord."""
    values = {}
    for name, hint in _hints(cls).items():
        if name not in payload:
            continue
        problem = check_type(payload[name], hint)
        if problem is not None:
            raise CorruptRecord(f"{where}: field {name!r}{what} {problem}")
        values[name] = payload[name]
    try:
        return cls(**values)
    except TypeError as exc:
        raise CorruptRecord(f"{where}: incomplete{what} ({exc})") from exc


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return {n: t for n, t in typing.get_type_hints(cls).items() if n in names}


def check_type(value: Any, hint: Any) -> str | None:
    """Why ``value`` (decoded JSON) is not of type ``hint``, or None when it is.

    Understands the annotations records use: ``int``, ``float`` (an integer is accepted;
    finite only), ``str`` (and ``str`` enums, whose values the record's own decode checks),
    ``bool``, ``Any``, ``list[T]``, ``tuple[T, ...]``, ``dict[str, T]`` and ``T | None``.
    """
    if hint is Any:
        return None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        problems = [check_type(value, a) for a in args]
        return None if any(p is None for p in problems) else problems[0]
    if hint is type(None):
        return None if value is None else f"is {_show(value)}, expected null"
    if hint is bool:
        return None if isinstance(value, bool) else f"is {_show(value)}, expected true/false"
    if hint is int:
        return None if type(value) is int else f"is {_show(value)}, expected an integer"
    if hint is float:
        if type(value) in (int, float) and math.isfinite(value):
            return None
        return f"is {_show(value)}, expected a finite number"
    if origin is None and isinstance(hint, type) and issubclass(hint, str):  # a str enum too
        return None if isinstance(value, str) else f"is {_show(value)}, expected a string"
    if origin in (list, tuple):
        if not isinstance(value, list):
            return f"is {_show(value)}, expected a list"
        inner = args[0] if args else Any
        for i, item in enumerate(value):
            problem = check_type(item, inner)
            if problem is not None:
                return f"[{i}] {problem}"
        return None
    if origin is dict:
        if not isinstance(value, dict):
            return f"is {_show(value)}, expected an object"
        inner = args[1] if len(args) == 2 else Any
        for k, item in value.items():
            problem = check_type(item, inner)
            if problem is not None:
                return f"[{k!r:.40}] {problem}"
        return None
    raise TypeError(f"records cannot check the type {hint!r}")  # a programming error


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def finite(value: Any, what: str) -> float:
    """``value`` as a finite float (JSON int or float, not a boolean)."""
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {_show(value)}")
    return float(value)
