"""The worker's read-only mappings of restore scratch, kept from one restore to the next.

A restore at another world size reads the rows its new shards need out of restore scratch: the
segments its daemon fetched peers' blocks into (:mod:`elasticd.store.scratch_space`, small
pages on every mount), handed over as descriptors. The daemon keeps a released segment, its
pages touched, for the job's next restore, and lands the next copy of the same old rank in the
same pages (:mod:`elasticd.store.scratch_pool`). Read through a mapping made for one restore
(or with ``preadv``) every 4 KiB page is looked up again: 0.19-0.23 CPU s per GiB. Through a
mapping kept from the last restore the pages are mapped already and the copy costs what one
between two buffers in memory does: 0.097 CPU s per GiB (576 MiB, medians of 6,
``bench/spikes/kept_mapping.py``, bench/results/restore36/).

A kept mapping holds no memory of its own: a segment the daemon deletes is emptied first
(``ScratchSpace.drop``), which takes its pages from every mapping. It keeps its file open, so
no other file takes that (device, inode) while it is kept; a file someone unlinked without
emptying it (the store's scan after a daemon crash) is unmapped at the next :meth:`map`.
Nothing is read from a kept mapping but under the pin of the ``ckpt_fetch`` that handed the
same file over again: the bytes are the daemon's, as through a fresh mapping. Worker side.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections import OrderedDict

from elasticd.snapshot.segment import map_fd

__all__ = ["KEEP", "SCRATCH_MAPS", "ScratchMaps"]

#: Mappings kept: a restore reads at most a few old ranks' scratch (two in the sharded bench).
KEEP = 8


class ScratchMaps:
    """Read-only mappings of scratch files by (device, inode), the most recent :data:`KEEP`.

    One restore at a time uses it (the worker's main thread).
    """

    def __init__(self) -> None:
        self.keep = KEEP
        #: (device, inode) -> (mapping, a descriptor of the file to see it unlinked)
        self._maps: OrderedDict[tuple[int, int], tuple[mmap.mmap, int]] = OrderedDict()
        #: :meth:`map` calls answered by a new mapping, and by one kept from an earlier
        #: restore (what the kept mapping saves shows only in the second: a bench reads them).
        self.made = self.reused = 0

    def map(self, fd: int, size: int) -> mmap.mmap:
        """A read-only mapping of the whole scratch file ``fd``, at least ``size`` bytes: the
        one kept from an earlier restore when it maps this very file, else a new one, kept.
        The caller never closes it (:meth:`close` does).

        Raises:
            ValueError: ``fd`` is not a regular file of ``size`` bytes or more.
        """
        self._forget_unlinked()
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        entry = self._maps.pop(key, None)
        if entry is not None and (entry[0].closed or len(entry[0]) < size):
            self._close(entry)
            entry = None
        if entry is None:
            mm = map_fd(fd, max(size, st.st_size), writable=False, populate=False)
            entry = (mm, os.dup(fd))
            self.made += 1
        else:
            self.reused += 1
        self._maps[key] = entry  # the most recent last
        while len(self._maps) > self.keep:
            self._close(self._maps.popitem(last=False)[1])
        return entry[0]

    def close(self) -> None:
        """Unmaps every kept mapping (one still viewed: when its last view goes)."""
        while self._maps:
            self._close(self._maps.popitem()[1])

    def _forget_unlinked(self) -> None:
        for key, (_, fd) in list(self._maps.items()):
            if os.fstat(fd).st_nlink == 0:
                self._close(self._maps.pop(key))

    @staticmethod
    def _close(entry: tuple[mmap.mmap, int]) -> None:
        mm, fd = entry
        os.close(fd)
        with contextlib.suppress(BufferError):  # a view still held: unmapped when dropped
            mm.close()


#: The worker process's kept mappings (a worker restores with one Checkpointer at a time).
SCRATCH_MAPS = ScratchMaps()
