"""What a restarted daemon adopts from the slot files under its root.

The daemon, not the worker, owns the slot files, so a snapshot survives a daemon restart: the
new daemon keeps every segment that is its own file (see
:meth:`~elasticd.snapshot.segment.Segment.open_verified`), whose header and payload checksums
verify and that sits in its own job/rank directory (the two newest per rank), and removes
everything else, so nothing may leak. Nothing is followed through a symlink
(:mod:`elasticd.store.shm_root`).
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Callable

from elasticd.snapshot.format import JOB_RE
from elasticd.snapshot.segment import Segment
from elasticd.store.api import ScanResult
from elasticd.store.shm_root import SEGMENT_RE, dir_problem, listdir_at, remove_at

__all__ = ["scan_root"]

#: (job, rank) -> (the next free file serial, its kept segments, newest first).
Found = dict[tuple[str, int], tuple[int, list[Segment]]]


def scan_root(fd: int, root: str) -> tuple[Found, ScanResult]:
    """Walks the root (descriptor ``fd``, path ``root`` for messages): the segments kept per
    (job, rank), and what was kept and removed."""
    found: Found = {}
    kept: list[tuple[str, int, int, int]] = []
    removed: list[tuple[str, str]] = []

    def drop(name: str, why: str) -> None:
        # Anything under the root that is not a verified slot goes: nothing may leak. Restore
        # scratch is emptied first, as ScratchSpace.drop does: a worker keeps its mapping of
        # one from restore to restore (worker/scratch_maps.py), which would hold the pages.
        if name.startswith(".scratch-"):
            _empty(fd, name)
        remove_at(fd, name)
        removed.append((os.path.join(root, name), why))

    for job in sorted(os.listdir(fd)):
        if not JOB_RE.fullmatch(job) or dir_problem(fd, job):
            drop(job, "not a job directory")
            continue
        for rank_name in sorted(listdir_at(fd, job)):
            rel = f"{job}/{rank_name}"
            if (not rank_name.isdigit() or str(int(rank_name)) != rank_name
                    or dir_problem(fd, rel)):
                drop(rel, "not a rank directory")
                continue
            rank = int(rank_name)
            adopted = _adopt(fd, root, job, rank, rel, drop)
            if adopted is not None:
                found[(job, rank)] = adopted
                kept.extend((job, rank, s.header.generation, s.header.step)  # type: ignore
                            for s in adopted[1])
        if not listdir_at(fd, job):
            os.rmdir(job, dir_fd=fd)
    return found, ScanResult(kept, removed)


def _empty(fd: int, name: str) -> None:
    with contextlib.suppress(OSError):  # not a regular file, or gone: remove_at deals with it
        f = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        try:
            st = os.fstat(f)
            # Only a file that is this daemon's alone: truncating one with another link would
            # empty a file that lives elsewhere too.
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid():
                os.ftruncate(f, 0)
        finally:
            os.close(f)


def _adopt(fd: int, root: str, job: str, rank: int, rank_dir: str,
           drop: Callable[[str, str], None]) -> tuple[int, list[Segment]] | None:
    found: list[tuple[int, Segment]] = []
    for name in sorted(listdir_at(fd, rank_dir)):
        rel = f"{rank_dir}/{name}"
        match = SEGMENT_RE.fullmatch(name)
        if not match:
            drop(rel, "not a slot file")
            continue
        segment, why = Segment.open_verified(fd, rel, os.path.join(root, rel), job, rank)
        if segment is None:
            drop(rel, why)
        else:
            found.append((int(match.group(1)), segment))
    if not found:
        os.rmdir(rank_dir, dir_fd=fd)
        return None
    found.sort(key=lambda f: f[1].header.version(), reverse=True)  # type: ignore[union-attr]
    for _, segment in found[2:]:
        segment.unmap()
        drop(segment.name, "older than the two newest snapshots of this rank")
    return max(serial for serial, _ in found) + 1, [segment for _, segment in found[:2]]
