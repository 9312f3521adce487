"""systemd's notify protocol (sd_notify), without libsystemd.

With ``Type=notify`` systemd passes ``NOTIFY_SOCKET``; we send ``READY=1`` once the node has
joined, ``WATCHDOG=1`` after each completed main-loop cycle (so a stalled loop stops the pings
and systemd restarts the daemon), ``RELOADING=1`` on SIGHUP and ``STOPPING=1`` on shutdown.
Without ``NOTIFY_SOCKET`` (no systemd, e.g. inside a Slurm allocation) every call is a no-op.
"""

from __future__ import annotations

import contextlib
import os
import socket

from elasticd.printable import printable


class Notifier:
    """Sends sd_notify datagrams to ``$NOTIFY_SOCKET`` if it is set."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path if path is not None else os.environ.get("NOTIFY_SOCKET", "")
        self._sock: socket.socket | None = None
        if self.path:
            # Non-blocking: a full queue at systemd drops one ping rather than stall the loop.
            self._sock = socket.socket(
                socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)

    def notify(self, message: str) -> None:
        if self._sock is None:
            return
        addr = self.path
        if addr.startswith("@"):  # abstract namespace socket
            addr = "\0" + addr[1:]
        with contextlib.suppress(OSError):  # systemd went away; nothing useful to do about it
            self._sock.sendto(message.encode(), addr)

    def ready(self, status: str = "") -> None:
        # One line: a newline in the status (it may name a job's script) would add fields.
        self.notify("READY=1" + (f"\nSTATUS={printable(status)}" if status else ""))

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
