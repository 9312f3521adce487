"""One shared-memory slot file: allocating, pre-touching, mapping, verifying and removing it.

:class:`~elasticd.checkpoint.shm.SlotStore` decides which segment holds what; this module does the
file and memory work. Pages are reserved with ``fallocate`` so that a full tmpfs is an error at
allocation rather than a SIGBUS in whichever process first writes the page, and pre-touched,
because first writes into fresh tmpfs pages run ten times slower than memcpy (FACTS.md).
Daemon side: no torch.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from elasticd.checkpoint.format import SnapshotError, SnapshotHeader
from elasticd.checkpoint.reader import parse_header, verify_payload

PAGE = mmap.PAGESIZE


def map_file(path: str, size: int, *, writable: bool = True, populate: bool = True) -> mmap.mmap:
    """Maps a slot file, e.g. in the worker process that writes a snapshot into it.

    Args:
        path: the slot file (``Slot.path``).
        size: bytes to map (``Slot.capacity``).
        writable: map read-write (the worker writing a snapshot) or read-only.
        populate: pre-fault the mapping (MAP_POPULATE), so the first snapshot through a fresh
            mapping does not take one page fault per 4 KiB while the training loop waits.
    """
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        return mmap.mmap(fd, size, flags=flags, prot=prot)
    finally:
        os.close(fd)


class Segment:
    """A slot file and the daemon's mapping of it.

    Attributes:
        path, capacity: the file and its size.
        view: writable memoryview of the whole mapping.
        header: the sealed header of the complete snapshot it holds, or None.
        pins: readers that asked to keep it from being reused.
        ticket: the reservation currently writing into it (0 for none).
    """

    def __init__(self, path: str, capacity: int, mm: mmap.mmap) -> None:
        self.path, self.capacity, self._mm = path, capacity, mm
        self.view = memoryview(mm)
        self.header: SnapshotHeader | None = None
        self.pins = 0
        self.ticket = 0

    @classmethod
    def allocate(cls, path: str, capacity: int, mode: int = 0o600) -> "Segment":
        """Creates ``path`` (which must not exist) with ``capacity`` bytes reserved and touched.

        Raises:
            OSError: the file exists, or no room (ENOSPC); nothing is left behind.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.posix_fallocate(fd, 0, capacity)
            mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        # A write per page: the kernel allocates and zeroes it now, not during a snapshot.
        np.frombuffer(mm, dtype=np.uint8)[::PAGE] = 0
        return cls(path, capacity, mm)

    @classmethod
    def open_verified(cls, path: str, job: str, rank: int) -> tuple["Segment | None", str]:
        """Maps an existing slot file and checks that it holds a complete, intact snapshot of
        (job, rank): header and every payload checksum.

        Returns:
            (segment, "") when good; (None, why) otherwise (the file is left for the caller).
        """
        size = os.path.getsize(path)
        if size == 0:
            return None, "empty file"
        mm = map_file(path, size, populate=False)
        view = memoryview(mm)
        reason, header = "", None
        try:
            header = parse_header(view, job=job, rank=rank, where=path)
            verify_payload(view, header)
        except SnapshotError as exc:
            reason = str(exc)
        view.release()
        if reason:
            mm.close()
            return None, reason
        segment = cls(path, size, mm)
        segment.header = header
        return segment, ""

    def unmap(self) -> None:
        """Drops the daemon's mapping. Pages a reader still maps stay until it lets go."""
        try:
            self.view.release()
            self._mm.close()
        except BufferError:
            # Someone still holds a view; the mapping goes when they drop it.
            pass

    def destroy(self) -> None:
        """Unlinks the file and unmaps it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.unmap()
