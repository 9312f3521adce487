"""Signals turned into calls on a thread of their own.

A Python signal handler runs in the main thread between two bytecodes, possibly while that
thread holds a lock: the one inside the ``threading.Event`` the main loop waits on, for one
(``Event.wait`` and ``Event.clear`` take it). A handler that takes the same lock
(``Event.set``) then waits for itself forever, and the daemon ignores every later SIGTERM. So
the handler here only writes the signal's number to a pipe (a system call, no lock), and a
thread of the relay's own reads the pipe and makes the call. The daemon's SIGTERM and SIGHUP
come this way (:mod:`elasticd.daemon.main`), and so does an in-process agent's word of a failed
peer (:mod:`elasticd.agent.in_process_agent`: its monitor waits on an event too).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any, Callable, Mapping

log = logging.getLogger(__name__)


class SignalRelay:
    """Calls ``handlers[signum]()`` on the relay's thread for each signal received."""

    def __init__(self, handlers: Mapping[int, Callable[[], None]]) -> None:
        self._handlers = dict(handlers)
        # os.pipe() is close-on-exec: the job's processes do not inherit either end.
        self._read, self._write = os.pipe()
        # A full pipe (64 KiB of unread signals) drops one rather than block the handler.
        os.set_blocking(self._write, False)
        self._thread = threading.Thread(target=self._relay, name="signals", daemon=True)
        self._thread.start()
        #: The dispositions replaced, put back by close (an embedding process's own).
        self._before = {signum: signal.signal(signum, self._on_signal) for signum in self._handlers}

    def _on_signal(self, signum: int, _frame: Any) -> None:
        # The pipe is full (the calls are behind) or closed (shutting down).
        with contextlib.suppress(OSError):
            os.write(self._write, bytes([signum]))

    def _relay(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data:  # close() closed the write end
                return
            for signum in data:
                try:
                    self._handlers[signum]()
                except Exception:  # noqa: BLE001 - the next signal must still be relayed
                    log.exception("handling signal %d failed", signum)

    def close(self) -> None:
        """Puts back the dispositions it replaced and stops the relay thread."""
        for signum, before in self._before.items():
            signal.signal(signum, signal.SIG_DFL if before is None else before)
        os.close(self._write)
        self._thread.join(5.0)
        os.close(self._read)
