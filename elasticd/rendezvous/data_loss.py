"""An etcd that came back empty under a training job: the round is written back, not lost.

Every member of the round in force holds it (the agent's control copy). When a re-list finds
the round record gone (nothing deletes a round: etcd restarted on an empty data directory), a
member writes it back, create-if-absent, rather than let every agent read "no round while training" as a
call to re-rendezvous (:func:`~.rounds.num_waiting`) and restart its workers. The closer
elected next finds every member's record re-written under its new lease, so no round closes.
"""

from __future__ import annotations

import logging

from elasticd.coordination.api import Compare, Coordinator, KeyValue, Put
from elasticd.rendezvous.grace import OutageGrace
from elasticd.rendezvous.records import RoundRecord

# The handler's logger: this is the handler's recovery.
log = logging.getLogger("elasticd.rendezvous.handler")


def restore_round(coord: Coordinator, grace: OutageGrace, key: bytes,
                  kept: RoundRecord) -> KeyValue:
    """Writes ``kept`` back at ``key`` unless another member did first; returns the record
    as stored (for the control copy's listing)."""
    ok, written = grace.call(
        lambda: coord.transaction([Compare(key, 0)], [Put(key, kept.encode())]),
        "writing back the round etcd lost")
    if ok:
        log.warning("etcd lost the rendezvous round %d: written back from this node's copy "
                    "(its workers keep training)", kept.round)
        return KeyValue(key, kept.encode(), create_revision=written, mod_revision=written)
    found = grace.call(lambda: coord.get(key), "reading the round back")
    return found if found is not None else KeyValue(key, kept.encode(), 0, 0)
