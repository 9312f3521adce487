"""Which processes are a job's on this node: the job's scope as its daemon started it, the
environment tag every process of a job carries, and a process's start time (with its pid, the
name of one process, never of a later one that got the same pid).

The agent's supervisor (:mod:`elasticd.agent.supervisor`) makes a job's scope; the daemon's
local socket (:mod:`elasticd.daemon.local_binding`) admits callers by it. It imports nothing
else of elasticd.
"""

from __future__ import annotations

import dataclasses

#: What every process the daemon starts for a job carries in its environment (its tag).
TAG_ENV = "ELASTICD_TAG"


@dataclasses.dataclass(frozen=True)
class JobScope:
    """The job running on this node, as the daemon started it.

    Attributes:
        uid: the uid its processes run as.
        roots: the processes every process of the job descends from (the agent, the zygote):
            pid -> start time (:func:`start_time`).
        world_max: the job's largest world (its spec's nnodes max x nproc_per_node), which
            no rank its processes name may reach
            (:class:`elasticd.daemon.local_binding.RankClaims`); None: unbounded.
    """

    job: str
    uid: int
    roots: dict[int, int]
    world_max: int | None = None


def stat_fields(pid: int) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the command name ([] when gone): the kernel's
    own record of the task, never the process's memory."""
    try:
        with open(f"/proc/{pid}/stat", "rb", buffering=0) as fh:
            return fh.read(4096).rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


def start_time(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since boot (-1 when it is gone): with the
    pid, it names one process, never a later one that got the same pid."""
    fields = stat_fields(pid)
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return -1
