"""The agent's end of the worker link (:mod:`elasticd.local.worker_link`): one connection per
local worker, what each said last, and the messages the agent sends them.

Runs inside torchrun's agent process of an in-process job (:mod:`.in_process_agent`). Threads:
one accepting, one reading per connection; the agent's monitor thread reads the state under
:attr:`LinkServer.cond`.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from typing import Any, Callable

from elasticd.errors import LocalProtocolError
from elasticd.local import worker_link as link

log = logging.getLogger(__name__)

#: What set a worker's collective timeout (``CollectiveTimeout.source``, worker side).
TIMEOUT_SOURCES = ("first_step", "learned", "floor")


class LinkServer:
    """Listens on a fresh unguessable name; admits processes of the agent's uid (or root).

    Attributes:
        name: the link's name (for :data:`elasticd.local.worker_link.LINK_ENV`).
        cond: guards ``conns`` and ``left``; notified on every message and hang-up.
        conns: local rank -> its worker's connection.
        left: local rank -> its worker's last ``left`` message.
        timeouts: local rank -> the collective timeout its worker's group has now, seconds.
        on_news: called after every message and hang-up (from the connection's thread; must
            not block): the agent's monitor wakes on a worker's ``left`` instead of its poll.
    """

    def __init__(self) -> None:
        self.name = secrets.token_hex(16)
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(link.address(self.name))
        self._srv.listen(64)
        self.cond = threading.Condition()
        self.conns: dict[int, socket.socket] = {}
        self.left: dict[int, dict[str, Any]] = {}
        self.timeouts: dict[int, float] = {}
        self.on_news: Callable[[], None] = lambda: None
        threading.Thread(target=self._accept, daemon=True, name="link-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            try:
                pid, uid, _gid = link.peer_credentials(conn)
            except OSError as exc:  # one odd caller must not stop every later worker linking
                log.warning("worker link: refused a caller whose credentials do not read: %s",
                            exc)
                conn.close()
                continue
            if uid not in (os.getuid(), 0):
                log.warning("worker link: refused pid %d of uid %d", pid, uid)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, pid), daemon=True,
                             name="link-read").start()

    def _serve(self, conn: socket.socket, pid: int) -> None:
        local: int | None = None
        while True:
            try:
                msg = link.recv(conn)
            except (OSError, LocalProtocolError) as exc:
                log.warning("worker link: pid %d: %s", pid, exc)
                msg = None
            changed = False
            with self.cond:
                if msg is None:
                    if local is not None and self.conns.get(local) is conn:
                        del self.conns[local]
                    self.cond.notify_all()
                    conn.close()
                    self.on_news()
                    return
                op = msg.get("op")
                if op == "hello" and isinstance(msg.get("local_rank"), int):
                    local = msg["local_rank"]
                    self.conns[local] = conn
                elif op == "left" and local is not None and isinstance(msg.get("round"), int):
                    self.left[local] = msg
                elif op == "timeout" and local is not None \
                        and isinstance(msg.get("seconds"), (int, float)):
                    changed = self.timeouts.get(local) != float(msg["seconds"])
                    self.timeouts[local] = float(msg["seconds"])
                self.cond.notify_all()
            if changed:  # logged out of the lock, once per value taken
                # Which rule set it is what a partition's or a freeze's recovery turns on.
                source = msg.get("source")
                log.info("local rank %d: collective timeout %g s (%s)", local,
                         float(msg["seconds"]),
                         source if source in TIMEOUT_SOURCES else "source not given")
            self.on_news()

    def linked(self) -> set[int]:
        """The local ranks whose worker is connected now."""
        with self.cond:
            return set(self.conns)

    def left_rounds(self) -> dict[int, tuple[int, bool, str]]:
        """Local rank -> (round it left, whether cleanly, why), from its last ``left``."""
        with self.cond:
            return {r: (m["round"], bool(m.get("clean")), str(m.get("why", ""))[:200])
                    for r, m in self.left.items()}

    def collective_timeout(self, n: int) -> float | None:
        """The longest collective timeout the ``n`` local workers' groups have, seconds; None
        until every one of them said (a worker before this message, or not linked)."""
        with self.cond:
            values = [self.timeouts.get(r) for r in range(n)]
        return None if None in values else max(v for v in values if v is not None)

    def forget_left(self, keep_round: int) -> None:
        """Forgets the ``left`` notes but those of ``keep_round``: after a peer's death the
        workers leave (and say so) before the agent's monitor sees the change."""
        with self.cond:
            self.left = {r: m for r, m in self.left.items() if m.get("round") == keep_round}

    def send(self, local: int, msg: dict[str, Any]) -> bool:
        """Sends ``msg`` to local rank ``local``'s worker; False when it is not connected."""
        with self.cond:
            conn = self.conns.get(local)
        if conn is None:
            return False
        try:
            link.send(conn, msg)
            return True
        except OSError:
            return False

    def broadcast(self, msg: dict[str, Any], n: int) -> None:
        for r in range(n):
            self.send(r, msg)

    def wait(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for a message or a hang-up."""
        with self.cond:
            self.cond.wait(timeout)
