"""Telling a job's rendezvous that the daemons recorded a node ``failed``.

When this daemon records a peer ``failed`` (its lease expired, past the daemons' own
provisional rule), it writes the failure mark of that node's lease into the rendezvous of the
job it runs and deletes the join records that name that lease, in one transaction (and the closer's key,
when the closer was one of them)
(:mod:`elasticd.rendezvous.failures` says why and what the closer does with it). The mark is
bound to this daemon's lease: it goes when this daemon goes. Every survivor that runs the job
writes it (the same key and the same meaning: a second write changes nothing).
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


def mark_failed(coord: Coordinator, keys: Keyspace, job: str, node: str, lease: int,
                by: str, own_lease: int | None, at: float) -> int:
    """Writes ``node``'s failure mark for lease ``lease`` into ``job``'s rendezvous and deletes
    the join records naming it; returns how many it deleted.

    Raises:
        CoordinationError: etcd failed (the rendezvous then waits ``liveness_confirm``).
    """
    if not markable(node, lease):
        return 0
    native = keys.rendezvous(job).prefix + b"native/"
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
    # The members it names: a closer elected after their records went never saw them.
    mark = json.dumps({"v": 2, "node": node, "lease": lease, "by": by, "at": at,
                       "members": sorted(doomed.values())}, separators=(",", ":")).encode()
    coord.transaction([], [Put(mark_key(native, node, lease), mark, own_lease or 0),
                           *(Delete(k) for k in doomed)])
    if closer is not None and closer.value.decode(errors="replace") in doomed.values():
        # The closer was the failed node's agent: nobody closes a round until its key's lease
        # expires (up to a TTL after the failure). Its key goes now, unless another closer
        # took it meanwhile; the next one is elected at once (a dead closer cannot write: its
        # writes compare the key's creation).
        coord.transaction([Compare(closer.key, closer.mod_revision)], [Delete(closer.key)])
    log.info("told job %s's rendezvous that %s (lease %x) failed; %d join record(s) of it "
             "deleted%s", job, node, lease, len(doomed),
             ", and its closer's key" if closer is not None
             and closer.value.decode(errors="replace") in doomed.values() else "")
    return len(doomed)
