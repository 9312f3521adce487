"""Which jobs this node leaves aside for now, and until when: a pure decision, no I/O.

A job this node refused (its spec failed the node's checks, :mod:`elasticd.agent.job_check`)
stays refused while the records it was refused under stay the same: a new spec, or a control
an operator rewrote (``elasticctl retry``), gets it checked again. A job whose files are not on
this node yet (not deployed) waits: it is looked at again after its retry time, and only while
no other job runs here, so that a file that never comes holds up no later job.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

#: What a hold is tied to: the job's spec (or why it does not read) and its control.
Records = tuple[Any, Any]


@dataclasses.dataclass
class JobHolds:
    """The jobs held aside on this node (module docstring).

    Attributes:
        refused: job -> the records it was refused under.
        waiting: job -> (the records it waits under, when to look again).
    """

    refused: dict[str, Records] = dataclasses.field(default_factory=dict)
    waiting: dict[str, tuple[Records, float]] = dataclasses.field(default_factory=dict)

    def refuse(self, job: str, records: Records) -> None:
        self.refused[job] = records
        self.waiting.pop(job, None)

    def wait(self, job: str, records: Records, until: float) -> None:
        self.waiting[job] = (records, until)

    def held(self, job: str, records: Records, now: float, busy: bool) -> bool:
        """Whether ``job``, whose records are ``records`` now, is left aside at ``now``
        (``busy``: another job runs on this node). A hold whose records changed is dropped."""
        if job in self.refused:
            if self.refused[job] == records:
                return True
            del self.refused[job]
        if job in self.waiting:
            waited, until = self.waiting[job]
            if waited == records:
                return busy or now < until
            del self.waiting[job]
        return False

    def end_waits(self, wanted: Callable[[str], bool]) -> list[str]:
        """Drops the waiting jobs that are no longer ``wanted``; returns them."""
        gone = [job for job in self.waiting if not wanted(job)]
        for job in gone:
            del self.waiting[job]
        return gone
