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
a later round only as a newcomer, with a new record).

The closer follows the marks with a watch of its own (beside its node watch,
:mod:`.node_watch`), and learns of a mark the moment it is created, without waiting for the
deletes that follow it (a listing and a second write later: they were most of a round after a
kill, 60 ms of the 0.19 s after detection). A mark does at once what those deletes will do:

* a join record that names the marked daemon and lease and was last written before the mark
  was created (:func:`doomed`) counts as deleted (its member absent, and dead: no
  confirmation); a record written after the mark counts as any record (a node that came back
  and wrote again, as after a delete);
* an absent member whose last record named the marked daemon and lease is dead at once (the
  other order: the mark may come after the record expired, the two leases are not kept alive
  in step);
* a member nobody saw a record of (a closer elected after it went: the dead member was the
  closer, or the closer changed) is dead at once when a mark names it (a daemon names the join
  records it deleted).

A member merely silent (no mark, or a record with no daemon: plain torchrun) still waits
``liveness_confirm``. No etcd read happens while a confirmation is pending: the marks are in
the closer's memory, listed once when it is elected and followed after (before, a listing of
the marks every 20 ms while a member was absent, and one before each close).

Whoever may write the rendezvous prefix (the job's agents) could forge a mark; they can already
delete any member's record, which is all a mark does (a mark drops the records last written
before it; the member's next write counts again, as after a delete).
"""

from __future__ import annotations

import json


def mark_prefix(native: bytes) -> bytes:
    """The directory of the failure marks under a rendezvous' ``native/`` directory."""
    return native + b"failed/"


def mark_key(native: bytes, daemon: str, lease: int) -> bytes:
    """The failure mark of ``daemon``'s lease ``lease``."""
    return mark_prefix(native) + f"{daemon}@{lease:x}".encode()


def parse_mark_key(native: bytes, key: bytes) -> tuple[str, int] | None:
    """The daemon and lease the mark at ``key`` is of (None: not a mark :func:`mark_key`
    writes; anyone may write the prefix)."""
    prefix = mark_prefix(native)
    if not key.startswith(prefix):
        return None
    daemon, _, lease_hex = key[len(prefix):].decode(errors="replace").rpartition("@")
    try:
        lease = int(lease_hex, 16)
    except ValueError:
        return None
    if not markable(daemon, lease) or mark_key(native, daemon, lease) != key:
        return None
    return daemon, lease


def markable(daemon: str, lease: int) -> bool:
    """Whether a record naming ``daemon`` and ``lease`` can have a mark (it names both, and
    the node name is one key element)."""
    return bool(daemon) and lease > 0 and "/" not in daemon and "@" not in daemon


def doomed(daemon: str, lease: int, written: int, marked_at: int | None) -> bool:
    """Whether a join record naming ``daemon`` and ``lease``, last written at revision
    ``written``, counts as deleted by the mark of that lease created at revision ``marked_at``
    (None: no such mark): its survivor deletes it (or would have: it may die first)."""
    return marked_at is not None and markable(daemon, lease) and written < marked_at


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
