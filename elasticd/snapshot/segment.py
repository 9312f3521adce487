"""One shared-memory slot file: allocating, pre-touching, mapping, verifying and removing it.

:class:`~elasticd.store.shm.SlotStore` decides which segment holds what; this module does the
file and memory work. Pages are reserved with ``fallocate`` so that a full tmpfs is an error at
allocation rather than a SIGBUS in whichever process first writes the page, and pre-faulted,
because first writes into fresh tmpfs pages run ten times slower than memcpy (docs/facts.md).
On a tmpfs mounted with huge pages (``huge=within_size``, :mod:`elasticd.store.huge_pages`)
both cost a seventh (bench/results/slot_alloc.json): a 2 MiB page is reserved and mapped at
once instead of 512.

Every file is created and opened relative to a directory descriptor the store verified, with
``O_NOFOLLOW``, and a segment keeps its descriptor open: a worker is handed a descriptor of the
very file the daemon verified (:meth:`Segment.descriptor`, passed over the local socket) and maps
it with :func:`map_fd`, so nothing a path could be swapped to is ever mapped.
Daemon side (and :func:`map_fd` in workers): no torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import stat
import threading
from typing import Any

import numpy as np

from elasticd.snapshot.format import SnapshotError, SnapshotHeader
from elasticd.snapshot.reader import parse_header, verify_payload

PAGE = mmap.PAGESIZE
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC
# Linux 5.14's madvise advice (not in Python 3.11's mmap module): fault every page of the range
# in for writing with one call, about 0.6x the time of a write per page from user space.
MADV_POPULATE_WRITE = 23
_HUGE = 2 << 20  # a huge page on x86-64 and arm64 with 4 KiB base pages


def map_fd(fd: int, size: int, *, writable: bool = True, populate: bool = True) -> mmap.mmap:
    """Maps a slot file from its descriptor (the caller keeps and closes ``fd``).

    Args:
        fd: the slot file, as the daemon handed it over (``ckpt_reserve`` read-write,
            ``ckpt_open``/``ckpt_fetch`` read-only).
        size: bytes to map (``capacity``, or ``offset + size``).
        writable: map read-write (the worker writing a snapshot) or read-only.
        populate: pre-fault the mapping (MAP_POPULATE), so the first snapshot through a fresh
            mapping does not take one page fault per 4 KiB while the training loop waits.

    Raises:
        ValueError: ``fd`` is not a regular file of at least ``size`` bytes.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size < size:
        raise ValueError(f"descriptor {fd} is not a slot file of {size} bytes (a "
                         f"{stat.filemode(st.st_mode)} of {st.st_size} bytes)")
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size, flags=flags, prot=prot)


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_LIBC.madvise.restype = ctypes.c_int


def populate(mm: mmap.mmap, start: int, length: int) -> None:
    """``MADV_POPULATE_WRITE`` over ``length`` bytes of ``mm`` from the page-aligned ``start``,
    without holding the GIL: ``mmap.madvise`` holds it for the whole call (~0.4 s per GiB of
    fresh small pages here), and every other thread of the daemon stopped meanwhile: the
    stripe threads receiving from the other holders, the thread touching set-aside scratch,
    the workers' socket. ctypes drops the GIL around the call. The mapping is held exported
    for the call, so nothing closes it underneath (Segment.unmap then leaves it to the
    collector).

    Raises:
        OSError: the kernel's error (EINVAL before Linux 5.14; ENOMEM, EFAULT: no room).
        ValueError: the range is not within the mapping.
    """
    if start < 0 or length < 0 or start + length > len(mm) or start % PAGE:
        raise ValueError(f"range [{start}, {start + length}) of a mapping of {len(mm)} bytes")
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        if _LIBC.madvise(ctypes.addressof(anchor) + start, length, MADV_POPULATE_WRITE):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        del anchor


def prefault(mm: mmap.mmap, start: int = 0, end: int | None = None) -> None:
    """Maps every page of a fresh slot (or of its page-aligned range ``start``..``end``) for
    writing now, not during a snapshot or a fetch: one ``MADV_POPULATE_WRITE`` (the GIL let
    go, :func:`populate`), or on a kernel older than 5.14 (EINVAL) a write per page."""
    end = len(mm) if end is None else end
    try:
        populate(mm, start, end - start)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        np.frombuffer(mm, dtype=np.uint8)[start:end:PAGE] = 0


class Segment:
    """A slot file, its descriptor and the daemon's mapping of it.

    Attributes:
        path, capacity: the file (for messages and as the slot's identity) and its size.
        header: the sealed header of the complete snapshot it holds, or None.
        pins: readers that asked to keep it from being reused.
        ticket: the reservation currently writing into it (0 for none).
    """

    def __init__(self, path: str, name: str, capacity: int, mm: mmap.mmap, fd: int,
                 small_pages: bool = False) -> None:
        self.path, self.capacity, self._mm, self._fd = path, capacity, mm, fd
        self.small_pages = small_pages
        self.name = name  # relative to the store's root descriptor
        st = os.fstat(fd)
        self.identity = (st.st_dev, st.st_ino)  # what a worker's cached mapping is keyed on
        self.view = memoryview(mm)
        self.header: SnapshotHeader | None = None
        #: What the store's tagger made for the sealed snapshot (replication's block tags).
        self.tags: Any = None
        self.pins = 0
        self.ticket = 0
        # The page ranges reserve_range has reserved and faulted in, sorted and merged: a kept
        # scratch segment reused for the next restore has them all, and populating them again
        # walked every page (~35 ms per 727 MB fetch here) for nothing. Several threads of one
        # fetch, and the touch that sets scratch aside, reserve ranges of a segment at once.
        self._reserved: list[tuple[int, int]] = []
        self._reserved_lock = threading.Lock()

    @classmethod
    def allocate(cls, dir_fd: int, name: str, path: str, capacity: int,
                 mode: int = 0o600, reserve: bool = True,
                 small_pages: bool = False) -> "Segment":
        """Creates ``name`` relative to the directory ``dir_fd`` (it must not exist) with
        ``capacity`` bytes reserved and touched; ``path`` is what it is called in messages.

        Args:
            reserve: False: the file is only sized, no page is reserved yet; the caller
                reserves each range with :meth:`reserve_range` before anything writes it.
            small_pages: with ``reserve`` False, :meth:`reserve_range` takes small pages
                even where the mount gives huge ones (see there).

        Raises:
            OSError: the file exists, or no room (ENOSPC); nothing is left behind.
        """
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, mode,
                     dir_fd=dir_fd)
        mm = None
        try:
            if reserve:
                os.posix_fallocate(fd, 0, capacity)
            else:
                os.ftruncate(fd, capacity)
            mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED)
            if reserve:
                prefault(mm)
            elif small_pages:
                # tmpfs gives a page faulted through a mapping so marked a small one whatever
                # its mount says (fallocate, which has no mapping, would take a huge one).
                mm.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:
            if mm is not None:
                mm.close()
            os.close(fd)
            os.unlink(name, dir_fd=dir_fd)
            raise
        return cls(path, name, capacity, mm, fd, small_pages and not reserve)

    def reserve_range(self, start: int, end: int) -> None:
        """Reserves and pre-faults the pages holding bytes ``start``..``end`` of a segment
        allocated with ``reserve=False`` (again for a range already reserved: nothing to do,
        its pages are there; a segment is never emptied but to be destroyed).

        With ``small_pages`` the pages are faulted in through the daemon's mapping (one
        ``MADV_POPULATE_WRITE``, which reports a full tmpfs as an error where a write would
        get SIGBUS), so they are small ones; otherwise ``fallocate`` reserves them first.

        Raises:
            OSError: no room (ENOSPC, or EFAULT/ENOMEM from the populate): nothing may write
                the range.
        """
        unit = PAGE if self.small_pages else _HUGE
        # Whole pages of the kind the range gets: on a tmpfs with huge pages a range cut
        # mid-page is given small pages (neighbouring ranges reserve the page twice, which is
        # harmless).
        lo = start - start % unit
        hi = min(self.capacity, -(-end // unit) * unit)
        if hi <= lo or self._is_reserved(lo, hi):
            return
        if self.small_pages:
            try:
                populate(self._mm, lo, hi - lo)
                self._mark_reserved(lo, hi)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # a kernel before 5.14: fallocate, then write
                    raise
        os.posix_fallocate(self._fd, lo, hi - lo)
        prefault(self._mm, lo, hi)
        self._mark_reserved(lo, hi)

    def _is_reserved(self, lo: int, hi: int) -> bool:
        """Whether one reserved range covers ``[lo, hi)``."""
        with self._reserved_lock:
            return any(a <= lo and hi <= b for a, b in self._reserved)

    def _mark_reserved(self, lo: int, hi: int) -> None:
        with self._reserved_lock:
            merged = []
            for a, b in sorted([*self._reserved, (lo, hi)]):
                if merged and a <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], b))
                else:
                    merged.append((a, b))
            self._reserved = merged

    @classmethod
    def open_verified(cls, dir_fd: int, name: str, path: str, job: str,
                      rank: int) -> tuple["Segment | None", str]:
        """Maps an existing slot file and checks that it is the daemon's own (a regular file
        owned by this uid, with no other link and no group or other write) holding a complete,
        intact snapshot of (job, rank): header and every payload checksum.

        Returns:
            (segment, "") when good; (None, why) otherwise (the file is left for the caller).
        """
        try:
            fd = os.open(name, os.O_RDWR | _OPEN_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            return None, f"cannot open: {exc.strerror}"
        try:
            st = os.fstat(fd)
            why = foreign(st)
            if why or st.st_size == 0:
                os.close(fd)
                return None, why or "empty file"
            mm = map_fd(fd, st.st_size, populate=False)
        except (OSError, ValueError) as exc:
            os.close(fd)
            return None, f"cannot map: {exc}"
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
            os.close(fd)
            return None, reason
        segment = cls(path, name, st.st_size, mm, fd)
        segment.header = header
        return segment, ""

    def descriptor(self, writable: bool) -> int:
        """A new descriptor of this very file, for a worker (the caller closes it): read-write
        for a reservation, read-only (a new open file description through ``/proc/self/fd``,
        which names the open file, not a path) for a restore."""
        if writable:
            return os.dup(self._fd)
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

    def unmap(self) -> None:
        """Drops the daemon's mapping and descriptor. Pages a reader still maps stay until it
        lets go."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(BufferError):  # a view still held: unmapped when dropped
            self.view.release()
            self._mm.close()

    def destroy(self, dir_fd: int, reclaim: bool = False) -> None:
        """Unlinks the file (its name relative to ``dir_fd``, the store's root) and unmaps it.

        Args:
            reclaim: empty the file first, so that its pages go now even while a reader
                still maps it (the reader's next access faults): for memory the daemon must
                get back whatever the reader does. Nothing of the daemon may touch it after.
        """
        if reclaim and self._fd >= 0:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.name, dir_fd=dir_fd)
        self.unmap()


def foreign(st: os.stat_result, directory: bool = False) -> str:
    """Why a file (or a ``directory``) is not one only the daemon controls ("" when it is)."""
    if not (stat.S_ISDIR if directory else stat.S_ISREG)(st.st_mode):
        return "not a directory" if directory else "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by the daemon (uid {os.geteuid()})"
    if not directory and st.st_nlink != 1:
        return f"has {st.st_nlink} links"
    if st.st_mode & 0o022:
        return f"writable by other users (mode {stat.S_IMODE(st.st_mode):#o})"
    return ""
