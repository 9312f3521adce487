"""Rows of a slot read in place, copied with ``pread`` from its file instead of through its
mapping, or, on huge pages, with one ``memmove`` out of the mapping.

A reshard reads the old ranks' snapshots in place: their tensors are views of the slot files
the daemon handed over (verified, pinned, mapped read-only), and the resharder copies the rows
the new shard needs out of them. Through the mapping, every 4 KiB page those rows lie on is
faulted in first and its page-table entry torn down again at the unmap: on ``/dev/shm``'s small
pages that cost as much as the copy itself (576 MiB of rows, one rank of the sharded bench:
0.23-0.25 CPU s from a mapping, 0.10-0.11 between two tensors in memory, same hold). ``preadv``
from the same descriptor copies the file's pages into the destination without mapping them:
whole rows, one call per piece of a shard. On huge pages the mapping costs next to nothing and
the kernel's copy is the dearer one: one libc ``memmove`` per piece out of the mapping took
0.086 CPU s per GiB against ``preadv``'s 0.179 (small pages: 0.253 against 0.245, so those keep
``preadv``; ``bench/spikes/worker_copy.py``, bench/results/restore35/). Restore scratch is
copied out of its mapping too: one the worker keeps from restore to restore
(:mod:`elasticd.worker.scratch_maps`), whose pages are mapped already (0.097 CPU s per GiB
against ``preadv``'s 0.228 on small pages, bench/results/restore36/). The bytes are the same
ones either way (the descriptor the daemon handed over and its mapping, never a path; the slot
stays pinned until the piece is released), so nothing the daemon checked is read from anywhere
else. Worker side: imports torch.
"""

from __future__ import annotations

import ctypes
import math
import os
from typing import Any, Iterable, NamedTuple

import numpy as np
import torch


def mapping_address(buffer: Any) -> int:
    """The address a mapped slot (an ``mmap``, read-only or not) starts at."""
    return int(np.frombuffer(buffer, dtype=np.uint8, count=1).ctypes.data)


#: A tmpfs file's ``st_blksize`` where its mount gives it huge pages (4 KiB otherwise).
_HUGE_PAGE = 2 << 20


def huge_page_file(fd: int) -> bool:
    """Whether the slot file ``fd`` is on a tmpfs that gives it huge pages: tmpfs reports a
    huge page as the file's block size there (after any system-wide ``shmem_enabled``
    override)."""
    return os.fstat(fd).st_blksize >= _HUGE_PAGE


class RowCopy(NamedTuple):
    """One copy of whole rows out of a slot file (:meth:`SlotFiles.locate`)."""

    mapping: int  # the address the slot file's mapping starts at
    fd: int
    huge: int  # the mapping's length when the rows are copied out of it, else 0
    at: int  # the rows' offset in the file
    into: int  # the address they are copied to
    nbytes: int


class SlotFiles:
    """The slot files a restore's pieces are mapped from, each by the address its mapping starts
    at (the file's offset 0): its descriptor and, for a file whose rows are copied out of the
    mapping (on huge pages, or restore scratch in a kept mapping), the mapping's length (0:
    ``preadv``). The pieces own the descriptors and the mappings: they are valid until
    the pieces are released, which is after the load.
    """

    def __init__(self, files: Iterable[tuple[int, int, int]] = ()) -> None:
        self._files = {address: (fd, huge) for address, fd, huge in files}

    def __bool__(self) -> bool:
        return bool(self._files)

    def locate(self, out: torch.Tensor, dst: tuple[slice, ...], t: torch.Tensor,
               src: tuple[slice, ...]) -> RowCopy | None:
        """The copy :meth:`read` makes of ``t[src]`` into ``out[dst]``: from which slot file,
        where in it, to which address; None when :meth:`read` would copy nothing."""
        if not self._files or t.dim() == 0 or t.dtype != out.dtype:
            return None
        base = t.untyped_storage().data_ptr()
        fd, huge = self._files.get(base, (None, 0))
        if fd is None or not (t.is_contiguous() and out.is_contiguous()):
            return None
        for d in range(1, t.dim()):
            if (src[d].start, src[d].stop, dst[d].start, dst[d].stop) != (0, t.shape[d], 0,
                                                                            out.shape[d]):
                return None
        rows = src[0].stop - src[0].start
        if not (0 <= src[0].start <= src[0].stop <= t.shape[0] and 0 <= dst[0].start
                and dst[0].stop - dst[0].start == rows and dst[0].stop <= out.shape[0]):
            return None
        row = math.prod(t.shape[1:]) * t.element_size()
        at = t.data_ptr() - base + src[0].start * row
        if huge and at + rows * row > huge:  # past the mapping: not this slot's bytes
            return None
        return RowCopy(base, fd, huge, at, out.data_ptr() + dst[0].start * row, rows * row)

    def read(self, out: torch.Tensor, dst: tuple[slice, ...], t: torch.Tensor,
             src: tuple[slice, ...]) -> bool:
        """Copies ``t[src]`` into ``out[dst]`` from the slot file ``t`` is a view of (``preadv``;
        ``memmove`` out of its mapping where its length was given), when both are one run of bytes (whole
        rows of contiguous tensors: only dimension 0 is cut, as FSDP2's ``Shard(0)`` cuts)
        inside both tensors; False, having copied nothing, when they are not or ``t`` is not a
        view of a slot file given here (torch's indexing then copies, or refuses the box)."""
        copy = self.locate(out, dst, t, src)
        if copy is None:
            return False
        if not copy.nbytes:
            return True
        if copy.huge:
            ctypes.memmove(copy.into, copy.mapping + copy.at, copy.nbytes)
            return True
        start = copy.into - out.data_ptr()
        into = memoryview(out.detach().view(-1).view(torch.uint8).numpy())
        into = into[start : start + copy.nbytes]
        got = 0
        while got < len(into):
            n = os.preadv(copy.fd, [into[got:]], copy.at + got)
            if n <= 0:  # the slot is pinned at its size: a short file is not that slot
                raise OSError(f"slot file ended {len(into) - got} bytes short of a shard's rows")
            got += n
        return True


class Landed(SlotFiles):
    """Slot files some of whose row copies were made before the load: a direct fetch
    (:mod:`elasticd.worker.direct`) landed those rows in the live tensors straight from the
    wire. :meth:`read` makes none of ``landed`` (they are in place) and every other copy as
    :class:`SlotFiles` does."""

    def __init__(self, files: Iterable[tuple[int, int, int]], landed: Iterable[RowCopy]) -> None:
        super().__init__(files)
        self._landed = set(landed)

    def read(self, out: torch.Tensor, dst: tuple[slice, ...], t: torch.Tensor,
             src: tuple[slice, ...]) -> bool:
        if self.locate(out, dst, t, src) in self._landed:
            return True
        return super().read(out, dst, t, src)
