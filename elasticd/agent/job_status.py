"""This node's status entry for a job, ``jobs/<job>/nodes/<node>``, and its publishing.

The entry is bound to the node's lease, so a dead node's entry disappears with it. The job
manager sets the state it is in (running, restarting, refused...: a new status, the worker
group's fields starting over); the worker group and the checkpoint service change single fields
of it from their own threads (:meth:`JobStatusBoard.edit`). A change is written at the next
publish; a new step alone is not (it goes with the next real change, or the daemon's heartbeat).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

from elasticd.clock import Clock
from elasticd.cluster.jobspec import JobState, NodeJobStatus
from elasticd.coordination.api import Coordinator
from elasticd.coordination.keys import Keyspace


class JobStatusBoard:
    """This node's job status, as published (owned by the job manager).

    Args:
        lease: returns the node's current lease (0 when it has none: nothing is published).

    Attributes:
        about: the job the status is about (the running one, or one refused or waited for),
            None before any.
    """

    def __init__(self, node_id: str, coord: Coordinator, keys: Keyspace,
                 lease: Callable[[], int], clock: Clock) -> None:
        self.node_id = node_id
        self._coord = coord
        self._keys = keys
        self._lease = lease
        self._clock = clock
        self.status = NodeJobStatus(node=node_id, state=JobState.IDLE)
        self.about: str | None = None
        self._published: NodeJobStatus | None = None
        self._lock = threading.Lock()  # fields change on the local API's threads too

    def set(self, state: JobState, detail: str, about: str | None = None,
            **fields: Any) -> None:
        """A new status (``about``: the job it is now about, if that changes)."""
        with self._lock:
            self.status = NodeJobStatus(self.node_id, state, detail, at=self._clock.wall(),
                                        **fields)
            if about is not None:
                self.about = about

    def edit(self, change: Callable[[NodeJobStatus], dict[str, Any]]) -> NodeJobStatus:
        """Changes fields of the status: ``change`` gets the status now and returns the fields
        that change (none: ``{}``), under the board's lock. Returns the status before."""
        with self._lock:
            before = self.status
            fields = change(before)
            if fields:
                self.status = dataclasses.replace(before, **fields)
            return before

    def publish(self, job: str | None = None) -> None:
        """Writes the status under ``job`` (default: the job it is about) if it changed.

        Raises:
            CoordinationError: etcd did not take it (written again at the next publish).
        """
        job = job or self.about
        status = self.status
        # The step moves every training step: published with the next real change (or the
        # daemon's heartbeat), not one etcd write per step. ``hang_timeout`` and
        # ``compute_seconds`` are rounded to two digits for the same reason (worker_group.py).
        same = (self._published is not None
                and dataclasses.replace(status, last_step=0, at=0)
                == dataclasses.replace(self._published, last_step=0, at=0))
        lease = self._lease()
        if job is None or not lease or same:
            return
        self._coord.put(self._keys.job_keys(job).node(self.node_id), status.encode(), lease)
        self._published = status

    def withdraw(self, job: str) -> None:
        """Deletes this node's entry under ``job`` (its status is about another job now)."""
        self._coord.delete(self._keys.job_keys(job).node(self.node_id))

    def lost(self) -> None:
        """The entry went with etcd's data: written again at the next publish."""
        self._published = None
