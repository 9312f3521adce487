"""Handover: survivors that completed one step more than others hand its snapshot over.

A DDP step finishes on some ranks only when a peer dies inside its gradient ``all_reduce``:
a ring collective completes on the ranks that received every reduced chunk and fails on the
others (docs/in-process-design.md, risk 4). Those that completed step S+1 hold its snapshot
in their own slot; the others hold S. Every rank that completed S+1 holds the same model and
optimizer (each took the same fully reduced gradient), which a failure-free run holds at S+1,
so for replicated (not sharded) state one survivor's snapshot of S+1 is a whole restore for
any rank, exactly as a restarted rank loads old rank ``r % old``'s after a shrink.

How the agreement makes S+1 the first candidate, how :func:`plan` pairs each rank lacking it
with a holder, what the receiver checks, why no commit rule is touched and why sharded state
is not handed over: docs/in-process-design.md §4.5. Worker side: imports torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

Version = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Handover:
    """Who sends ``version`` to whom: (holder, receiver) rank pairs, the same on every rank."""

    version: Version
    pairs: tuple[tuple[int, int], ...]

    def sender_to(self, rank: int) -> list[int]:
        """The receivers ``rank`` sends to (none unless it is a holder)."""
        return [r for h, r in self.pairs if h == rank]

    def holder_of(self, rank: int) -> int | None:
        """The holder ``rank`` receives from, or None when it holds the version itself."""
        return next((h for h, r in self.pairs if r == rank), None)


def plan(offers: list[list[Version]], common: set[Version]) -> Handover | None:
    """The step one survivor more completed, and who hands it to whom; None when there is none.

    Args:
        offers: each rank's own offers (in rank order; every rank a survivor).
        common: the versions every rank offers.

    Only the newest version offered, when some rank lacks it, it is in the generation of the
    newest common version and newer than it: the step after the last one all completed, on
    their one timeline (a version of another generation would be an abandoned one). Each
    receiver is paired with the holders in turn.
    """
    if not common:
        return None
    newest = max(v for rows in offers for v in rows)
    base = max(common)
    if newest in common or newest[0] != base[0] or newest <= base:
        return None
    holders = [r for r, rows in enumerate(offers) if newest in rows]
    receivers = [r for r, rows in enumerate(offers) if newest not in rows]
    return Handover(newest, tuple((holders[i % len(holders)], r)
                                 for i, r in enumerate(receivers)))


def exchange(handover: Handover, rank: int, payload: torch.Tensor | None,
             collective: Any) -> torch.Tensor | None:
    """Sends ``payload`` (this holder's snapshot bytes; None when it could not read its own
    copy) to each of its receivers, or receives this rank's from its holder. Returns the
    bytes received (None when the holder had none), or ``payload`` on a holder."""
    holder = handover.holder_of(rank)
    if holder is None:
        size = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64)
        for receiver in handover.sender_to(rank):
            collective.send(size, receiver)
            if payload is not None:
                collective.send(payload, receiver)
        return payload
    size = torch.zeros(1, dtype=torch.int64)
    collective.recv(size, holder)
    if int(size[0]) <= 0:
        return None
    data = torch.empty(int(size[0]), dtype=torch.uint8)
    collective.recv(data, holder)
    return data
