"""How the worker's checkpoint engine reaches its node's daemon: the ``Transport`` every
implementation derives from.

A transport needs only ``call(op, **fields)`` (the reply's fields; raises when the daemon
refuses or cannot be reached). The others have defaults built on it, so every transport has
all four and the Checkpointer asks no object what it can do: :meth:`Transport.start` (a call
whose reply is read later) and :meth:`Transport.send` (one-way) call at once, and
:meth:`Transport.close` does nothing. :class:`~elasticd.worker.client.DaemonClient` overrides
all of them over the daemon's socket; :class:`elasticd.testing.transport.InProcessTransport`
calls a service's handlers directly. Standard library only: loaded into every worker.
"""

from __future__ import annotations

from typing import Any

from elasticd.local.wire import close_fds


class Answered:
    """A call already answered (or failed), read like a :class:`~elasticd.worker.client.
    PendingCall`."""

    def __init__(self, reply: dict[str, Any]) -> None:
        self._reply: dict[str, Any] | None = reply

    def result(self) -> dict[str, Any]:
        reply, self._reply = self._reply, None
        if reply is None:
            raise RuntimeError("the reply was already taken")
        return reply

    def close(self) -> None:
        reply, self._reply = self._reply, None
        if reply is not None:
            close_fds(reply.get("_fds", ()))


class Transport:
    """Requests to the node's daemon; subclasses give :meth:`call`."""

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """The daemon's reply to ``op`` (its fields).

        Raises:
            Exception: any, when the daemon refused or could not be reached.
        """
        raise NotImplementedError

    def start(self, op: str, **fields: Any) -> Any:
        """Sends ``op`` and returns something whose ``result()`` is the reply and whose
        ``close()`` drops it unread. Default: the call made now (:class:`Answered`)."""
        return Answered(self.call(op, **fields))

    def send(self, op: str, **fields: Any) -> bool:
        """Sends ``op`` one-way (no reply waited for); whether it went (False: dropped,
        nothing of it reached the daemon, the caller may call instead). Default: a call."""
        self.call(op, **fields)
        return True

    def close(self) -> None:
        """Closes the connection (the next request opens another). Default: nothing."""
