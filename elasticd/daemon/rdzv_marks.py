"""Telling a job's rendezvous that the daemons recorded a node ``failed``.

When a daemon records a peer ``failed`` (its lease expired, past the daemons' own provisional
rule), the failure mark of that node's lease goes into the rendezvous of the job it runs, and
the join records that name that lease are deleted (and the closer's key, when the closer was
one of them) (:mod:`elasticd.rendezvous.failures` says why and what the closer does with it).
The mark is bound to its writer's lease: it goes when that daemon goes.

Every survivor that runs the job sees the same failure, but only one does the work: each creates
the mark only if it is absent, and the one whose create wins lists the rendezvous and deletes
the records: one listing and one or two writes per failure, not N - 1 of each (every write an
event to every daemon's ``jobs/`` watch). The rendezvous' closer does not wait for the deletes:
it follows the marks, and a mark counts the records it dooms as deleted from its creation on
(:mod:`elasticd.rendezvous.failures`). If the winner dies or meets an etcd error between its
create and its deletes, nobody deletes them: the closer has counted them gone at the mark all
the same, and they go when their agent's lease expires; a dead closer's key, though, holds the
round until its lease expires.
"""

from __future__ import annotations

import json
import logging

from elasticd.coordination.api import Compare, Coordinator, Delete, Put
from elasticd.coordination.keys import Keyspace
from elasticd.coordination.records import RecordError
from elasticd.rendezvous.failures import mark_key, markable
from elasticd.rendezvous.records import NodeRecord

log = logging.getLogger("elasticd.daemon.daemon")


def _mark(node: str, lease: int, by: str, at: float, members: list[str]) -> bytes:
    # The members it names: a closer elected after their records went never saw them.
    return json.dumps({"v": 2, "node": node, "lease": lease, "by": by, "at": at,
                       "members": members}, separators=(",", ":")).encode()


def mark_failed(coord: Coordinator, keys: Keyspace, job: str, node: str, lease: int,
                by: str, own_lease: int | None, at: float) -> int:
    """Writes ``node``'s failure mark for lease ``lease`` into ``job``'s rendezvous unless it
    exists; the daemon that wrote it also deletes the join records naming that lease.

    Returns:
        How many join records it deleted (0 when another daemon's mark was there first).

    Raises:
        CoordinationError: etcd failed (the rendezvous then waits ``liveness_confirm``).
    """
    if not markable(node, lease):
        return 0
    native = keys.rendezvous(job).prefix + b"native/"
    key = mark_key(native, node, lease)
    if not coord.create(key, _mark(node, lease, by, at, []), own_lease or 0):
        return 0  # another survivor's: it lists and deletes
    kvs, _ = coord.get_prefix(native)
    doomed: dict[bytes, str] = {}
    closer = None
    for kv in kvs:
        if kv.key == native + b"round.closer":
            closer = kv
        if not kv.key.startswith(native + b"nodes/"):
            continue
        try:
            rec = NodeRecord.decode(kv.value)
        except RecordError:
            continue
        if rec.daemon == node and rec.daemon_lease == lease:
            doomed[kv.key] = rec.node
    # The mark rewritten with the members, in the deletes' transaction.
    ops = [Put(key, _mark(node, lease, by, at, sorted(doomed.values())), own_lease or 0),
           *(Delete(k) for k in doomed)]
    closer_went = closer is not None and closer.value.decode(errors="replace") in doomed.values()
    if closer_went:
        # The closer was the failed node's agent: nobody closes a round until its key's lease
        # expires (up to a TTL after the failure). Its key goes now, in the same transaction
        # (the successor's election starts a write sooner), unless another closer took it
        # meanwhile; the next one is elected at once (a dead closer cannot write: its writes
        # compare the key's creation).
        closer_went, _ = coord.transaction([Compare(closer.key, closer.mod_revision)],
                                           [*ops, Delete(closer.key)])
        if not closer_went:
            coord.transaction([], ops)
    elif doomed:
        coord.transaction([], ops)
    log.info("told job %s's rendezvous that %s (lease %x) failed; %d join record(s) of it "
             "deleted%s", job, node, lease, len(doomed),
             ", and its closer's key" if closer_went else "")
    return len(doomed)
