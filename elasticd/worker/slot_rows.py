"""Rows of a slot read in place, copied with ``pread`` from its file instead of through its
mapping.

A reshard reads the old ranks' snapshots in place: their tensors are views of the slot files
the daemon handed over (verified, pinned, mapped read-only), and the resharder copies the rows
the new shard needs out of them. Through the mapping, every 4 KiB page those rows lie on is
faulted in first and its page-table entry torn down again at the unmap: on ``/dev/shm``'s small
pages that cost as much as the copy itself (576 MiB of rows, one rank of the sharded bench:
0.23-0.25 CPU s from a mapping, 0.10-0.11 between two tensors in memory, same hold). ``preadv``
from the same descriptor copies the file's pages into the destination without mapping them:
whole rows, one call per piece of a shard. The bytes are the same ones (the descriptor the
daemon handed over, never a path; the slot stays pinned until the piece is released), so
nothing the daemon checked is read from anywhere else. Worker side: imports torch.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable

import numpy as np
import torch


def mapping_address(buffer: Any) -> int:
    """The address a mapped slot (an ``mmap``, read-only or not) starts at."""
    return int(np.frombuffer(buffer, dtype=np.uint8, count=1).ctypes.data)


class SlotFiles:
    """The descriptors of the slot files a restore's pieces are mapped from, each by the address
    its mapping starts at (the file's offset 0). The pieces own the descriptors: they are valid
    until the pieces are released, which is after the load.

    Args:
        files: (mapping address, descriptor) of each piece read in place.
    """

    def __init__(self, files: Iterable[tuple[int, int]] = ()) -> None:
        self._fds = dict(files)
        #: Bytes copied with ``preadv`` (the rest went through the mappings).
        self.bytes_read = 0

    def __bool__(self) -> bool:
        return bool(self._fds)

    def read(self, out: torch.Tensor, dst: tuple[slice, ...], t: torch.Tensor,
             src: tuple[slice, ...]) -> bool:
        """Copies ``t[src]`` into ``out[dst]`` with ``preadv`` from the file ``t`` is a view of,
        when both are one run of bytes (whole rows of contiguous tensors: only dimension 0 is
        cut, as FSDP2's ``Shard(0)`` cuts); False, having copied nothing, when they are not or
        ``t`` is not a view of a slot file given here."""
        if not self._fds or t.dim() == 0 or t.dtype != out.dtype:
            return False
        fd = self._fds.get(t.untyped_storage().data_ptr())
        if fd is None or not (t.is_contiguous() and out.is_contiguous()):
            return False
        for d in range(1, t.dim()):
            if (src[d].start, src[d].stop, dst[d].start, dst[d].stop) != (0, t.shape[d], 0,
                                                                            out.shape[d]):
                return False
        row = math.prod(t.shape[1:]) * t.element_size()
        rows = src[0].stop - src[0].start
        if not rows or not row:
            return True
        at = t.data_ptr() - t.untyped_storage().data_ptr() + src[0].start * row
        into = memoryview(out.detach().view(-1).view(torch.uint8).numpy())
        into = into[dst[0].start * row : (dst[0].start + rows) * row]
        got = 0
        while got < len(into):
            n = os.preadv(fd, [into[got:]], at + got)
            if n <= 0:  # the slot is pinned at its size: a short file is not that slot
                raise OSError(f"slot file ended {len(into) - got} bytes short of a shard's rows")
            got += n
        self.bytes_read += got
        return True
