"""A port held free for the workers' store while an agent waits for its round.

torch's handlers pick the workers' ``MASTER_PORT`` when the round is known: rank 0's agent binds
port 0, reads the number, closes, writes it to the store, and every other agent reads it back
(two requests each, and polls while rank 0 has not written). Here each agent holds a bound (not
listening) socket on a free port from its join until its round closes and names the port in its
join record; the closer copies rank 0's into the round record, so no agent asks the store. Held
bound, the port cannot be taken by another process meanwhile; it is released when the round is
known, as torch's is, just before the worker binds it.
"""

from __future__ import annotations

import socket


class HeldPort:
    """At most one port held at a time."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None

    def hold(self, addr: str) -> int:
        """Releases the port held, if any, and holds a new one; 0 when none could be bound."""
        self.release()
        sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
        try:
            sock.bind(("", 0))
        except OSError:
            sock.close()
            return 0
        self._sock = sock
        return sock.getsockname()[1]

    def release(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
