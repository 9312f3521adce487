"""The checkpoint service called in process: :class:`InProcessTransport`, the
:class:`~elasticd.worker.transport.Transport` that calls a service's handlers directly (in
production: :class:`~elasticd.worker.client.DaemonClient`), for unit tests and benchmarks that
want the engine without a daemon. It pushes every request and reply through JSON exactly as
the socket would, so a field that could not cross the real wire fails here too; descriptors a
reply hands over (``"_fds"``) are duplicated for the caller and the handler's copies closed, as
passing them over the socket does. Standard library only (no torch).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

from elasticd.errors import LocalProtocolError
from elasticd.local.wire import RequestError, close_fds
from elasticd.worker.transport import Transport


class TransportError(LocalProtocolError):
    """The in-process service refused a request (the message is the daemon's)."""


class InProcessTransport(Transport):
    """Calls ``handlers`` (e.g. ``CheckpointService.handlers()``) directly.

    Args:
        handlers: op name → handler, as served by the local socket.
        uid: the peer uid the handlers see (default: this process's).
    """

    def __init__(self, handlers: Mapping[str, Callable[[dict[str, Any]], Any]],
                 uid: int | None = None) -> None:
        self.handlers = dict(handlers)
        self.peer = {"pid": os.getpid(), "uid": os.geteuid() if uid is None else uid,
                     "gid": os.getegid()}

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        fields.pop("timeout", None)  # DaemonClient's keyword, not a field
        handler = self.handlers.get(op)
        if handler is None:
            raise TransportError(f"unknown op {op!r}")
        msg = json.loads(json.dumps({**fields, "op": op}, allow_nan=False))
        msg["_peer"] = dict(self.peer)
        try:
            reply = handler(msg)
        except RequestError as exc:
            raise TransportError(f"elasticd refused {op!r}: {exc}") from exc
        reply = dict(reply or {})
        handed = reply.pop("_fds", [])
        try:
            out = json.loads(json.dumps(reply, allow_nan=False))
            if handed:
                out["_fds"] = [os.dup(fd) for fd in handed]
        finally:
            close_fds(handed)
        return out
