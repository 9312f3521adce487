"""A piece of a version a restoring rank fetched: one old rank's snapshot as tensors (owned
copies, or views of a slot or staging buffer read in place), with what it takes to let go of
them (:mod:`elasticd.worker.sources`, :mod:`elasticd.worker.direct`). Worker side: imports
torch."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from elasticd.snapshot.format import dtensor_nodes
from elasticd.worker.slot_rows import SlotFiles


@dataclasses.dataclass
class Fetched:
    """One old rank's snapshot as a restore holds it (and, on the base piece of a reshard, the
    other old ranks' in :attr:`others`)."""

    tensors: list[torch.Tensor]
    meta: dict[str, Any]
    source: str
    nbytes: int
    names: list[str] = dataclasses.field(default_factory=list)
    #: The other old ranks' snapshots this rank's new shards need (sharded state).
    others: list["Fetched"] = dataclasses.field(default_factory=list)
    #: Why the sharded state cannot be placed into this state ("" when it can).
    error: str = ""
    #: Lets go of the slot a piece read in place maps (its tensors are views of it).
    release: Callable[[], None] | None = None
    #: Which old rank's snapshot this is, when fetched for another world size.
    rank: int | None = None
    #: (mapping address, descriptor, mapping length or 0) of the slot file a piece read in
    #: place maps, until its ``release`` (which closes the descriptor): the resharder reads
    #: rows from the file, or out of the mapping where its length is given (slot_rows.py).
    slot_file: tuple[int, int, int] | None = None
    #: The snapshot's bytes as they lay in the slot (uint8), kept to hand over (handover.py).
    raw: torch.Tensor | None = None
    #: What the resharder reads rows through in place of :meth:`slot_files`'s: a direct
    #: fetch's (:mod:`.direct`), which skips the rows it landed in place already.
    files: SlotFiles | None = None
    #: A direct fetch's figures (:mod:`.direct`), reported to the daemon with the restore.
    figures: dict[str, Any] | None = None

    def slot_files(self) -> SlotFiles:
        """The slot files of this piece and the others read in place (for the resharder)."""
        if self.files is not None:
            return self.files
        return SlotFiles(p.slot_file for p in (self, *self.others) if p.slot_file is not None)

    def close(self) -> None:
        """Releases the slots the pieces were read from in place."""
        for piece in (*self.others, self):
            if piece.release is not None:
                release, piece.release, piece.tensors = piece.release, None, []
                piece.slot_file = None
                release()  # the views are gone first, so the slot unmaps now


def own_unsharded(got: Fetched) -> Fetched:
    """This rank's old snapshot read in place for a reshard: its sharded entries stay views
    (the resharder copies the rows it needs out of them, where copying the whole snapshot out
    first cost a copy and the page faults of fresh memory, 385 MB a rank in the bench), every
    other entry becomes an owned copy (loaded objects keep what they are given). A snapshot
    with no sharded entry is copied whole and its slot let go at once."""
    sharded = {n["i"] for n in dtensor_nodes(got.meta) if type(n.get("i")) is int}
    got.tensors = [t if i in sharded else t.clone() for i, t in enumerate(got.tensors)]
    if not sharded and got.release is not None:
        release, got.release, got.slot_file = got.release, None, None
        release()
    return got
