"""Versioned records stored in etcd.

Every value elasticd writes is a JSON object with a schema version ``schema`` and a record type
``record``, beside the record's own fields. A
reader refuses, with a clear error, a record it cannot read: not JSON (corrupt), the wrong kind,
or a newer schema than it knows (written by a newer elasticd: upgrade this node). JSON and not
pickle: nothing read from etcd may run code.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Type, TypeVar

SCHEMA_VERSION = 1


class RecordError(ValueError):
    """A stored record could not be read."""


class CorruptRecord(RecordError):
    """The bytes are not a record of the expected kind."""


class UnsupportedRecordVersion(RecordError):
    """The record was written with a newer schema than this elasticd understands."""


R = TypeVar("R")


_ENVELOPE = ("schema", "record")


def encode(kind: str, payload: dict[str, Any]) -> bytes:
    clash = [k for k in _ENVELOPE if k in payload]
    if clash:
        raise ValueError(f"record fields {clash} are reserved for the envelope")
    body = {"schema": SCHEMA_VERSION, "record": kind, **payload}
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def decode(raw: bytes, kind: str, key: bytes | str = b"?") -> dict[str, Any]:
    """Returns the payload of a record of ``kind`` (without the envelope).

    Raises:
        CorruptRecord: not JSON, not an object, or another kind.
        UnsupportedRecordVersion: a schema newer than :data:`SCHEMA_VERSION`.
    """
    where = key.decode(errors="replace") if isinstance(key, bytes) else key
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptRecord(f"{where}: not a valid record ({exc.__class__.__name__}: {exc})") from exc
    if not isinstance(body, dict) or not isinstance(body.get("schema"), int):
        raise CorruptRecord(f"{where}: not a versioned elasticd record")
    if body["schema"] > SCHEMA_VERSION:
        raise UnsupportedRecordVersion(
            f"{where}: written with record schema v{body['schema']}, this elasticd reads up to "
            f"v{SCHEMA_VERSION}; upgrade elasticd on this node"
        )
    if body.get("record") != kind:
        raise CorruptRecord(f"{where}: expected a {kind!r} record, found {body.get('record')!r}")
    for k in _ENVELOPE:
        body.pop(k)
    return body


def encode_dataclass(kind: str, obj: Any) -> bytes:
    return encode(kind, dataclasses.asdict(obj))


def decode_dataclass(cls: Type[R], raw: bytes, kind: str, key: bytes | str = b"?") -> R:
    """Decodes into ``cls``, ignoring unknown fields (added by a newer minor writer) and
    rejecting missing required ones."""
    payload = decode(raw, kind, key)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    try:
        return cls(**{k: v for k, v in payload.items() if k in names})
    except TypeError as exc:
        where = key.decode(errors="replace") if isinstance(key, bytes) else key
        raise CorruptRecord(f"{where}: incomplete {kind!r} record ({exc})") from exc
