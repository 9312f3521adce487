"""A member whose node the daemons recorded ``failed`` is gone at once (issue 31, §4.2 of
docs/in-process-design.md).

The rendezvous counts a member dead once its record has been absent for ``liveness_confirm``
seconds (provisional expiry: an etcd paused past the TTL expires every lease at once, and must
drop nobody). The daemons already make that judgement for their nodes, with their own
provisional rule (``elasticd.cluster.membership``), and record the result: a ``failed`` event
against the node's lease. Waiting ``liveness_confirm`` again after it only delays every
recovery: an in-process one waits for it from detection on (0.5 s under a daemon, against a
0.15 s budget for the whole re-formation).

The failure mark's protocol (the join record naming its daemon's lease, the mark
``native/failed/<node>@<lease hex>`` a daemon creates only if absent and the winner's deletes,
what the closer's watch of the marks counts dead at once, and why a forged mark is no worse
than a deleted record): docs/in-process-design.md §4.2. A member merely silent (no mark, or a
record with no daemon: plain torchrun) still waits ``liveness_confirm``.
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


def marked_members(raw: bytes) -> set[str]:
    """The members a mark's value names (a mark that does not read names none)."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return set()
    members = data.get("members") if isinstance(data, dict) else None
    return {m for m in members if isinstance(m, str)} if isinstance(members, list) else set()
