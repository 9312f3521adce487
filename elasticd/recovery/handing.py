"""Replication sessions a daemon opens to hand to its job's worker (``ckpt_sessions``): one per
remote holder of an old rank's snapshot, scoped to the job, each describing that copy first so
that the block key handed over with it is the copy's (:mod:`elasticd.replication.handed`)."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from elasticd.replication.api import ReplicationError, Version
from elasticd.replication.deadline import LinkRates
from elasticd.replication.handed import Ticket, hand_over
from elasticd.replication.lanes import Connections

log = logging.getLogger(__name__)


def hand_sessions(connections: Connections, holders: Sequence[str], me: str, job: str,
                  rank: int, version: Version, rates: LinkRates
                  ) -> list[tuple[str, Any, int, Ticket]]:
    """A session scoped to ``job`` to each of ``holders`` (but ``me``) that describes
    ``rank``'s ``version``, handed over with that copy's block key: ``(holder, the daemon's
    client, a descriptor to send, the ticket)``. The caller sends and closes each descriptor
    and keeps each client to :func:`~elasticd.replication.handed.cut_off` its session. A
    holder that cannot be reached or does not hold the version is left out (logged)."""
    out = []
    for holder in holders:
        if holder == me:
            continue
        client = None
        try:
            # A holder frozen or black-holed costs its deadline floor here, as in a fetch,
            # not the pool's timeout (the worker waits for this answer).
            floor = rates.deadline(holder, 0)
            client = connections.open_scoped(holder, job, connect_timeout=floor)
            client.describe(job, rank, version, deadline=floor)
            salt = client.tag_salt
            keys = {} if salt is None or client.blocks is None else {
                salt: client.blocks.key(salt)}
            fd, ticket = hand_over(client, keys)
        except (ReplicationError, OSError, ValueError) as exc:
            log.info("%s rank %d %s: no session from %s to hand over: %s", job, rank, version,
                     holder, exc)
            if client is not None:
                client.close()
            continue
        out.append((holder, client, fd, ticket))
    return out
