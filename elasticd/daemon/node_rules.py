"""The node's safety rules as pure decisions: when it fences, how long an outage is borne,
what an etcd data loss asks for, what its record and its cycle sentence say.

Nothing here does I/O, takes a lock or reads a clock: the daemon (:mod:`elasticd.daemon.daemon`)
and its parts gather what was observed (leases the keep-alive found lost, which of them peers
declared failed, how long etcd has been unreachable, ``now``), ask these rules, and carry out
the answer. The rules (each tested alone in ``tests/unit/test_node_rules.py``, over every order
of events too):

* **Fencing, declared dead.** A lease found lost is a *suspect* until ``provisional_seconds +
  2`` seconds later; if peers recorded a ``failed`` event against it meanwhile, the node fences
  (stops every job process it runs) before it rejoins. Past the window, the suspect is dropped.
* **Outage grace.** While etcd is unreachable the node keeps its workers running; once the
  outage lasts longer than ``outage_grace`` (0: for ever) it fences.
* **One fence at a time.** A fenced node does not fence again; registering again lifts it.
* **Data loss.** An etcd that came back empty is recovered from without declaring anyone
  failed: the job specs are written again before the nodes are re-listed, failed events
  against old leases are forgotten (they went with the data), this node's record and replica
  records are written again, and the loss is recorded once per cluster incarnation.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class FenceOrder:
    """Fence now: stop every job process, record ``fenced`` against ``lease`` (None: the
    node's current lease)."""

    reason: str
    lease: int | None = None


#: Seconds past the provisional grace that a lost lease is still looked at (peers record a
#: failure only after the provisional grace; the slack covers their cycle).
SUSPECT_SLACK = 2.0


class FenceBook:
    """Whether this node must fence, from what it observed. No I/O.

    Attributes:
        suspects: lost leases of this node -> until when (monotonic) to look for a ``failed``
            event against them.
        fenced: the node is fenced (its job processes stopped) and has not registered since.
        fenced_for: why the node was fenced last ("" if never; kept after it registered again,
            for /status).
    """

    def __init__(self) -> None:
        self.suspects: dict[int, float] = {}
        self.fenced = False
        self.fenced_for = ""

    def lease_lost(self, lease: int, now: float, provisional_seconds: float) -> None:
        """The keep-alive found ``lease`` gone: peers may declare this node failed."""
        self.suspects[lease] = now + provisional_seconds + SUSPECT_SLACK

    def judge(self, declared: Iterable[int], now: float) -> FenceOrder | None:
        """Rules on the suspects, given those against which peers recorded a failure
        (``declared``: suspect leases with a ``failed`` event in etcd)."""
        declared = set(declared)
        order = None
        for lease, until in list(self.suspects.items()):
            if lease in declared:
                del self.suspects[lease]
                order = order or self.fence(
                    f"declared dead by peers (lease {lease:x} expired)", lease)
            elif now > until:
                del self.suspects[lease]
        return order

    def outage(self, outage_seconds: float, grace: float,
               kind: str | None = None) -> FenceOrder | None:
        """etcd has failed this node for ``outage_seconds``: fence once past the grace.
        ``kind`` says how (:attr:`elasticd.coordination.health.EtcdHealth.kind`; default
        "unreachable"), so the reason an operator reads names the fix."""
        if grace and outage_seconds > grace:
            return self.fence(f"etcd {kind or 'unreachable'} for more than {grace:.0f} s")
        return None

    def fence(self, reason: str, lease: int | None = None) -> FenceOrder | None:
        """A fence for ``reason``, unless the node is fenced already."""
        if self.fenced:
            return None
        self.fenced, self.fenced_for = True, reason
        return FenceOrder(reason, lease)

    def registered(self) -> bool:
        """The node registered again: the fence is lifted (its reason stays, for /status).
        Returns whether it was fenced."""
        was, self.fenced = self.fenced, False
        return was

    def data_lost(self) -> None:
        """etcd lost its data: failed events against old leases went with it."""
        self.suspects.clear()


def describe_outage(gone: float, grace: float, fenced: bool, kind: str = "unreachable") -> str:
    """The cycle sentence while etcd is unreachable (or refuses us: ``kind``, as
    :attr:`EtcdHealth.kind` says)."""
    if fenced:
        return (f"etcd {kind} for {gone:.1f} s; fenced (workers stopped) after the "
                f"{grace:.0f} s grace; retrying")
    return (f"etcd {kind} for {gone:.1f} s; keeping workers running for "
            f"{max(0.0, grace - gone):.1f} s more; retrying")


def look_for_data_loss(looked_at_cycle: int, cycle: int, again: bool) -> bool:
    """Whether to read the cluster's incarnation key now: at most once a cycle, unless the
    caller has a new reason (a re-list found a revision the incarnation did not expect)."""
    return again or looked_at_cycle != cycle


class Recover(enum.Enum):
    """One step of the recovery from an etcd data loss, in the order :func:`data_loss_plan`
    gives them."""

    REPUBLISH_SPECS = "republish job specs and controls"
    RESET_WATCHES = "restart every watch from the new cluster's revision"
    FORGET_SUSPECTS = "forget failed events against old leases"
    RELIST_NODES = "re-list the nodes, declaring nobody failed"
    REWRITE_RECORD = "write this node's record again"
    REPUBLISH_REPLICAS = "write the replica records again"
    RECORD_EVENT = "record etcd_data_lost"


def data_loss_plan(first: bool, registered: bool, replicates: bool) -> tuple[Recover, ...]:
    """What this node does when etcd came back empty.

    Args:
        first: this node is the first to see this loss (it records the event).
        registered: the node holds a lease it registered with (its record is written again;
            without one, the cycle registers anew).
        replicates: the node keeps replica records.
    """
    steps = [Recover.REPUBLISH_SPECS, Recover.RESET_WATCHES, Recover.FORGET_SUSPECTS,
             Recover.RELIST_NODES]
    if registered:
        steps.append(Recover.REWRITE_RECORD)
    if replicates:
        steps.append(Recover.REPUBLISH_REPLICAS)
    if first:
        steps.append(Recover.RECORD_EVENT)
    return tuple(steps)


class RecordWrite(enum.Enum):
    """What the cycle does about this node's record."""

    NONE = "none"
    REGISTER = "register"  # no lease registered: create the record (if the id is free)
    REWRITE = "rewrite"  # the record went while the lease lives, or a heartbeat is due


def record_write(registered: bool, leaving: bool, record_gone: bool,
                 heartbeat_interval: float, since_heartbeat: float) -> RecordWrite:
    """Liveness is the lease: the record is written when the node is not registered, when it
    went missing, and on a timer only if ``heartbeat_interval`` asks for one."""
    if not registered:
        return RecordWrite.NONE if leaving else RecordWrite.REGISTER
    if record_gone or (heartbeat_interval and since_heartbeat >= heartbeat_interval):
        return RecordWrite.REWRITE
    return RecordWrite.NONE


#: The least time between two writes of the record for a new sentence.
SENTENCE_PUBLISH_INTERVAL = 1.0


def publish_sentence(sentence: str, published: str, etcd_up: bool, registered: bool,
                     since_write: float) -> bool:
    """Whether the cycle's new sentence goes into the node's record now (at most once a
    second; a change within that second goes out at the next cycle after it)."""
    return (sentence != published and etcd_up and registered
            and since_write >= SENTENCE_PUBLISH_INTERVAL)


def cycle_sentence(node: str, alive: int, notes: list[str], job: str | None,
                   pending: Iterable[str]) -> str:
    """What the node is doing, in one sentence (logged when it changes, in /status)."""
    if notes:
        return "; ".join(notes) + f" ({alive} nodes alive)"
    if job is not None:
        return f"running job {job}: I am {node}, {alive} nodes alive"
    waiting = sorted(pending)
    if waiting:
        return (f"waiting for {', '.join(waiting)} to re-register after an etcd outage "
                f"before recording a failure; I am {node}, {alive} nodes alive")
    return f"no action: I am {node}, {alive} nodes alive"
