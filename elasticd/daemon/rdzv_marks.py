"""Telling a job's rendezvous that the daemons recorded a node ``failed``.

When this daemon records a peer ``failed`` (its lease expired, past the daemons' own
provisional rule), it writes the failure mark of that node's lease into the rendezvous of the
job it runs and deletes the join records that name that lease, in one transaction
(:mod:`elasticd.rendezvous.failures` says why and what the closer does with it). The mark is
bound to this daemon's lease: it goes when this daemon goes. Every survivor that runs the job
writes it (the same key and the same meaning: a second write changes nothing).
"""

from __future__ import annotations

import json
import logging

from elasticd.coordination.api import Coordinator, Delete, Put
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
    kvs, _ = coord.get_prefix(native + b"nodes/")
    doomed = []
    for kv in kvs:
        try:
            rec = NodeRecord.decode(kv.value)
        except RecordError:
            continue
        if rec.daemon == node and rec.daemon_lease == lease:
            doomed.append(kv.key)
    mark = json.dumps({"v": 2, "node": node, "lease": lease, "by": by, "at": at},
                      separators=(",", ":")).encode()
    coord.transaction([], [Put(mark_key(native, node, lease), mark, own_lease or 0),
                           *(Delete(k) for k in doomed)])
    log.info("told job %s's rendezvous that %s (lease %x) failed; %d join record(s) of it "
             "deleted", job, node, lease, len(doomed))
    return len(doomed)
