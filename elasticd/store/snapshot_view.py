"""A complete snapshot held in a slot, read in place: what the store hands its readers.

:meth:`SlotStore.latest <elasticd.store.shm.SlotStore.latest>` returns one; pushes and fetches
send its bytes, the checkpoint service hands workers a descriptor of its file. No torch.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from elasticd.snapshot.format import SnapshotHeader
from elasticd.snapshot.reader import SnapshotReader
from elasticd.snapshot.segment import Segment


class SnapshotView:
    """The latest complete snapshot of one (job, rank), read in place (no copy).

    The bytes stay valid until the store reuses the slot, which happens at the second
    :meth:`SlotStore.reserve` after this one was taken; a *pinned* view (``latest(pin=True)``)
    prevents that until :meth:`release` (a reserve then raises :class:`SlotBusy`).

    Args:
        unpin: what lets go of its pin (None: the view is not pinned).
        verify: check the payload against its checksums now (raises CorruptSnapshot).
    """

    def __init__(self, segment: Segment, unpin: Callable[[Segment], None] | None,
                 verify: bool) -> None:
        self.header: SnapshotHeader = segment.header  # type: ignore[assignment]
        self.tags = segment.tags  # what the store's tagger made at seal time, or None
        self.path = segment.path
        self.buffer = segment.view[: self.header.layout.total_size].toreadonly()
        # Parsed again from the bytes only when they are verified now or read by name: a
        # push or a fetch serves the bytes by the header the store holds (parsing a header
        # of a few hundred entries cost each fetch request ~2 ms).
        self._reader = (SnapshotReader(self.buffer, verify=True, where=segment.path)
                        if verify else None)
        self._segment, self._unpin = segment, unpin

    def array(self, name: str) -> np.ndarray:
        if self._reader is None:
            self._reader = SnapshotReader(self.buffer, where=self.path)
        return self._reader.array(name)

    def descriptor(self) -> int:
        """A new read-only descriptor of the slot file (for a worker; the caller closes it)."""
        return self._segment.descriptor(writable=False)

    def release(self) -> None:
        if self._unpin is not None:
            unpin, self._unpin = self._unpin, None
            unpin(self._segment)

    def __enter__(self) -> "SnapshotView":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
