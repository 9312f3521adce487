"""An in-process job's re-formation after a peer's failure, as the daemon follows it.

The job's agent re-forms its live workers itself (:mod:`.in_process_agent`) and says when it
is done (``reformed``, over the daemon's local socket, with the path its workers took). The
daemon keeps a backstop deadline (:meth:`job_rules.JobBook.reform_started`): past it, with no
word from the agent, it restarts the workers as it does for a job not in the mode.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from elasticd.agent.job_rules import REFORM_DEADLINE, JobBook
from elasticd.agent.worker_group import WorkerGroup
from elasticd.clock import Clock
from elasticd.metrics import Metrics

log = logging.getLogger(__name__)


class ReformWatch:
    """Starts, ends and enforces the daemon's deadline of a re-formation (part of the job
    manager: :class:`elasticd.agent.manager.JobManager`)."""

    def __init__(self, book: JobBook, group: WorkerGroup, metrics: Metrics, clock: Clock,
                 note: Callable[[str], None]) -> None:
        self._book, self._group, self._metrics = book, group, metrics
        self._clock, self._note = clock, note
        #: Guards the book's deadline (``reform_by``): the main loop starts and checks it,
        #: the local API's thread ends it (``reformed``).
        self._lock = threading.Lock()

    def started(self, peer: str, deadline: float = REFORM_DEADLINE) -> None:
        """``peer`` failed and the job's agent re-forms its workers in-process, within the
        job's ``deadline`` after its round (the daemon's backstop adds an allowance)."""
        with self._lock:
            self._book.reform_started(self._clock.monotonic(), deadline)
        note = (f"peer {peer} of {self._group.job} failed: its agent re-forms the workers "
                "in-process (restarted if it has not within the deadline)")
        self._note(note)
        log.info("%s", note)

    def on_reformed(self, msg: dict[str, Any]) -> None:
        """The agent re-formed its workers (``path``: ``in_process``, or ``restart`` when it
        fell back): the deadline ends (any thread)."""
        path = msg.get("path")
        if msg.get("job", self._group.job) != self._group.job \
                or path not in ("in_process", "restart"):
            return
        with self._lock:
            self._book.reform_ended()
        self._metrics.rendezvous.recoveries.labels(path).inc()
        if path == "restart":
            self._metrics.jobs.worker_restarts.labels("peer_failed").inc()
        log.info("%s re-formed by %s%s", self._group.job, path.replace("_", "-"),
                 f": {str(msg.get('why'))[:200]}" if msg.get("why") else "")

    def check(self) -> None:
        """Once a cycle: past the deadline with no word from the agent, today's restart."""
        with self._lock:
            overdue = self._book.reform_overdue(self._clock.monotonic())
        if not overdue:
            return
        n = self._group.restart_workers("in-process re-formation overdue")
        self._metrics.rendezvous.recoveries.labels("restart").inc()
        self._metrics.jobs.worker_restarts.labels("peer_failed").inc()
        self._note(f"restarted {n} workers of {self._group.job}: its agent did not re-form "
                   "them in-process by the deadline")
