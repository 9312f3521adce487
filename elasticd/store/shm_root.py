"""The root directory of a node's snapshot slots, claimed safely and walked without following
links.

The root's name (``/dev/shm/elasticd-<node>`` by default) is predictable and ``/dev/shm`` is
writable by every local user, so it is checked at every start (:func:`claim_root`): it must be a
directory (not a symlink) of the daemon's own, writable by nobody else, and is made 0700;
anything else found there — a tree another user created first, with a crafted snapshot in it —
is moved aside unread and a fresh root made exclusively. Every directory and file below it is
then created, listed and removed relative to the root's descriptor, never through a symlink
(the helpers here), by :class:`~elasticd.store.shm.SlotStore`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import stat
import uuid

from elasticd.snapshot.segment import foreign
from elasticd.store.api import SlotStoreError

log = logging.getLogger(__name__)

#: A slot file in its rank's directory (a job's directory is named as snapshot.format.JOB_RE).
SEGMENT_RE = re.compile(r"(\d+)\.slot")

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def claim_root(root: str, attempts: int = 3) -> int:
    """Returns a descriptor of ``root``, a directory of the daemon's own with mode 0700: an
    existing one (a restarted daemon's, whose slots :meth:`SlotStore.scan` then verifies), or a
    new one after anything else at that name was renamed aside to ``<root>.foreign-<random>``.

    Raises:
        SlotStoreError: the name could not be claimed (someone keeps re-creating it), or the
            foreign entry could not be moved aside.
        OSError: the parent directory cannot be created or read.
    """
    root = os.path.abspath(root)
    os.makedirs(os.path.dirname(root), mode=0o755, exist_ok=True)
    why = ""
    for _ in range(attempts):
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, 0o700)
        try:
            fd = os.open(root, DIR_FLAGS)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                raise
            fd, why = -1, "a symlink or not a directory"
        if fd >= 0:
            why = foreign(os.fstat(fd), directory=True)
            if not why:
                os.fchmod(fd, 0o700)
                return fd
            os.close(fd)
        aside = f"{root}.foreign-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(root, aside)  # renames the entry itself, never what a symlink names
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise SlotStoreError(f"shm dir {root} is {why} and cannot be moved aside ({exc}); "
                                 "remove it, or pick another --shm-dir") from exc
        log.warning("shm dir %s was %s: moved it aside to %s unread (nothing in it is used; "
                    "remove it once inspected) and created a new one", root, why, aside)
    raise SlotStoreError(f"shm dir {root} is {why} again after {attempts} attempts to move it "
                         "aside: another user keeps re-creating it; pick another --shm-dir in "
                         "a directory only root can write")


def listdir_at(dir_fd: int, rel: str) -> list[str]:
    """Names in ``rel`` (relative to ``dir_fd``, never through a symlink)."""
    fd = os.open(rel, DIR_FLAGS, dir_fd=dir_fd)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def dir_problem(dir_fd: int, rel: str) -> str:
    """Why ``rel`` is not a directory of the daemon's own ("" when it is)."""
    try:
        fd = os.open(rel, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        return exc.strerror or "cannot open"
    try:
        return foreign(os.fstat(fd), directory=True)
    finally:
        os.close(fd)


def remove_at(dir_fd: int, rel: str) -> None:
    """Removes ``rel`` (relative to ``dir_fd``): a tree without following symlinks, or one
    entry."""
    try:
        st = os.stat(rel, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(rel, dir_fd=dir_fd)
    else:
        os.unlink(rel, dir_fd=dir_fd)


def same_file(st: os.stat_result, path: str) -> bool:
    try:
        other = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino)
