"""Which ranks a job's processes may name on the daemon's socket: those of the spec's largest
world, and one rank per process.

Every rank a worker names costs the daemon state until the job ends: its progress and step
history, a slot pair in shared memory, a fetch lock, a "failing" reason. A connection's
writing ops were bound to the first rank it used (:mod:`elasticd.daemon.local_binding`), but
each new connection could claim a new rank, and a rank could be any integer, so one process
of the job could grow the daemon without bound. So:

* a rank (and a world size) a request names must lie within the job's largest world, its
  spec's ``nnodes_max x nproc_per_node`` (reads too: a restore after a resize reads old ranks,
  which were within the same spec's world);
* the writing ops of every connection of one process are bound to one rank: a process
  claims a rank with its first write, and another connection of the same pid that writes for
  another rank is refused while the claim holds. The claim ends with the process' last
  connection (a pid the kernel reuses later starts afresh).

The daemon's own uid outside any job is not bound (it is the operator's or a test's tool).
"""

from __future__ import annotations

import threading
from typing import Any


def outside_world(msg: dict[str, Any], world_max: int) -> str:
    """Why ``msg`` names a rank or world size beyond a world of ``world_max`` ranks ("" when
    it does not)."""
    rank, world = msg.get("rank"), msg.get("world_size")
    if type(rank) is int and not 0 <= rank < world_max:
        return (f"rank {rank} is outside the job's largest world ({world_max} ranks: its "
                "spec's nnodes max x nproc_per_node)")
    if type(world) is int and world > world_max:
        return (f"world size {world} is larger than the job's largest world ({world_max} "
                "ranks: its spec's nnodes max x nproc_per_node)")
    return ""


class RankClaims:
    """The rank each process of a job writes for, held while it has a connection open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (job, pid) -> [rank, connections of that pid bound to it]
        self._claims: dict[tuple[str, int], list[int]] = {}

    def claim(self, job: str, pid: int, rank: int) -> str:
        """A connection of ``pid`` binds its writes to ``rank``: "" when that is the pid's
        rank (or it had none), else why not. Each successful claim is matched by one
        :meth:`release` when that connection closes."""
        with self._lock:
            held = self._claims.get((job, pid))
            if held is None:
                self._claims[(job, pid)] = [rank, 1]
                return ""
            if held[0] != rank:
                return (f"pid {pid} writes for rank {held[0]} of {job} (on another connection), "
                        f"not rank {rank}: one rank per process")
            held[1] += 1
            return ""

    def release(self, job: str, pid: int) -> None:
        """A connection of ``pid`` that claimed its rank closed."""
        with self._lock:
            held = self._claims.get((job, pid))
            if held is not None:
                held[1] -= 1
                if held[1] <= 0:
                    del self._claims[(job, pid)]
