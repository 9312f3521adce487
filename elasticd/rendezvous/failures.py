"""A member whose node the daemons recorded ``failed`` is gone at once (issue 31, §4.2 of
docs/in-process-design.md).

The rendezvous counts a member dead once its record has been absent for ``liveness_confirm``
seconds (provisional expiry: an etcd paused past the TTL expires every lease at once, and must
drop nobody). The daemons already make that judgement for their nodes, with their own
provisional rule (``elasticd.cluster.membership``), and record the result: a ``failed`` event
against the node's lease. Waiting ``liveness_confirm`` again after it only delays every
recovery: an in-process one waits for it from detection on (0.5 s under a daemon, against a
0.15 s budget for the whole re-formation).

So a daemon's agent names its daemon and that daemon's lease in its join record
(:attr:`~.records.NodeRecord.daemon`), and a daemon that records a peer ``failed`` also
writes a **failure mark** into each rendezvous of a job it runs (``native/failed/<node>@<lease
hex>``, bound to its own lease: it goes when that daemon goes, and a failure seen by nobody
alive no longer matters); the survivor whose create of the mark wins deletes the join records
that name the failed node and lease (:mod:`elasticd.daemon.rdzv_marks`; the rendezvous' side
of the fence: the node, if it still runs, is fenced by its daemon, which
finds the ``failed`` event against its lost lease, or by its agent's daemon watch; it can enter
a later round only as a newcomer, with a new record). The closer then counts a member whose
record is absent as dead as soon as the mark for the daemon and lease its last record named
exists, without ``liveness_confirm``; a member merely silent (no mark, or a record with no
daemon: plain torchrun) still waits for it. The marks are looked up with one listing of
their directory, whatever the number of absent members (after an etcd pause past the TTL every
member is absent at once), at most every :data:`MARK_POLL` seconds while a confirmation is
pending (the mark may come after the record expired: the two leases are not kept alive in step).

Whoever may write the rendezvous prefix (the job's agents) could forge a mark; they can already
delete any member's record, which the mark only makes count sooner.

A closer elected after a member's record went (the dead member was the closer, or the closer
changed) never saw that record, so it does not know its daemon: it reads the marks' member
lists instead (a daemon names the join records it deleted), with one listing of the marks.
"""

from __future__ import annotations

import json

#: Seconds between two reads of a pending member's failure mark.
MARK_POLL = 0.02


def mark_prefix(native: bytes) -> bytes:
    """The directory of the failure marks under a rendezvous' ``native/`` directory."""
    return native + b"failed/"


def mark_key(native: bytes, daemon: str, lease: int) -> bytes:
    """The failure mark of ``daemon``'s lease ``lease``."""
    return mark_prefix(native) + f"{daemon}@{lease:x}".encode()


def markable(daemon: str, lease: int) -> bool:
    """Whether a record naming ``daemon`` and ``lease`` can have a mark (it names both, and
    the node name is one key element)."""
    return bool(daemon) and lease > 0 and "/" not in daemon and "@" not in daemon


def marked_members(values: list[bytes]) -> set[str]:
    """The members the marks ``values`` name (a mark that does not read names none)."""
    out: set[str] = set()
    for raw in values:
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            continue
        members = data.get("members") if isinstance(data, dict) else None
        if isinstance(members, list):
            out.update(m for m in members if isinstance(m, str))
    return out
