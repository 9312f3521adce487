"""The local channel between a node's daemon and its workers: framing, and the request error.

Both ends import this module: the daemon (:mod:`elasticd.daemon.local_api`) and every worker
process (:mod:`elasticd.worker.client`). It therefore uses the standard library only — a worker
must not pay for anything it does not need on every step.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON, one object::

    request  {"op": str, "id": int, ...fields}          (``"noreply": true`` → no answer; ``id``
                                                         may then be left out)
    reply    {"id": <request id>, "ok": true, ...result}
             {"id": <request id or null>, "ok": false, "error": "what went wrong"}

``op``, ``id``, ``noreply``, ``ok`` and ``error`` are the envelope's: other fields must use
other names (``_peer`` too: the daemon sets it from the kernel's peer credentials). A reply with
``"id": null`` answers no particular request: the daemon could not read one
(oversized, malformed) or refuses the connection; it closes the connection right after.
JSON rather than a binary layout: messages are a few dozen bytes, encoding costs a few µs,
and an operator can read them with ``socat``. Never pickle: the daemon reads these bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from typing import Any, Iterable

from elasticd.errors import LocalProtocolError

LENGTH = struct.Struct("!I")
DEFAULT_MAX_MESSAGE = 1 << 20

_encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


class FrameError(LocalProtocolError, ValueError):
    """Bytes that are not a valid frame of this protocol."""


def encode(message: dict[str, Any]) -> bytes:
    """Returns ``message`` as one frame (length prefix included).

    Raises:
        FrameError: ``message`` is not JSON-serialisable (e.g. a NaN or an object).
    """
    try:
        body = _encoder.encode(message).encode()
    except (TypeError, ValueError) as exc:
        raise FrameError(f"message cannot be sent as JSON: {exc}") from exc
    return LENGTH.pack(len(body)) + body


def check_length(length: int, max_message: int) -> None:
    """Raises :class:`FrameError` when a frame's announced length is not acceptable.

    Called on the 4-byte prefix alone, before anything is read or allocated for the body.
    """
    if length == 0:
        raise FrameError("empty frame (length 0); expected a JSON object")
    if length > max_message:
        raise FrameError(f"frame of {length} bytes is over the limit of {max_message} bytes")


def decode(body: bytes) -> dict[str, Any]:
    """Parses a frame's body into a JSON object.

    Raises:
        FrameError: not UTF-8, not JSON, or not an object.
    """
    try:
        message = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise FrameError(f"frame is not valid JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise FrameError(f"frame holds a JSON {type(message).__name__}, expected an object")
    return message


def recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes from ``sock``, or None when the stream ends first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, max_message: int, head: bytes = b"") -> dict[str, Any] | None:
    """One frame from a blocking socket (its length checked before the body is read), or None
    when the stream ends first; ``head``: the length's first bytes, already read.

    Raises:
        FrameError: a frame over ``max_message`` or not a JSON object.
        OSError: the connection failed.
    """
    rest = recv_exactly(sock, LENGTH.size - len(head))
    if rest is None:
        return None
    (length,) = LENGTH.unpack(head + rest)
    check_length(length, max_message)
    body = recv_exactly(sock, length)
    return None if body is None else decode(body)


class RequestError(LocalProtocolError):
    """Raised by a handler to refuse a request: the message goes to the worker as the error.

    Unlike any other exception, it is logged without a traceback: it is an expected answer
    ("no slot for rank 3: over the memory cap"), not a bug in the daemon.
    """


def close_fds(fds: Iterable[int]) -> list[int]:
    """Closes every descriptor (errors ignored: they are ours to drop); returns []."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    return []
