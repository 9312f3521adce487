"""Files the root daemon opens in a directory that a job's user can write.

A job's log directory (``<state_dir>/jobs/<job>``) belongs to the job's user: torchrun and the
workers write there. The daemon, as root, still creates ``agent.log`` in it and hands the open
file to the job's processes. Anything root does by path in such a directory would follow
whatever the job's user put there: a symlink ``agent.log -> /etc/shadow`` would have root append
to (and give the job) any file on the machine. So every step here goes through a descriptor of
the directory itself, opened without following links, and the file is opened relative to it
with ``O_NOFOLLOW``; an entry that is not a plain file of root's or the job user's own (a
symlink, a FIFO, a hard link to someone else's file) is removed and created afresh, never
followed.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

from elasticd.errors import NodeError

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted under the name must not hang the daemon in open() (a FIFO opened
# for writing with no reader fails with ENXIO instead).
_APPEND_FLAGS = (os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
                 | os.O_CLOEXEC)
_ATTEMPTS = 3


class UnsafeJobFile(NodeError, OSError):
    """The job's directory or file could not be opened without following the job user's links."""


def open_job_log(directory: str, name: str, uid: int | None, gid: int = -1) -> int:
    """Creates ``directory`` if missing, gives it to ``uid`` and opens ``name`` in it to append.

    ``directory``'s parent must be the daemon's own: only its final component, opened with
    ``O_NOFOLLOW`` (module docstring), may belong to the job's user.

    Args:
        uid: the job's user (``gid`` its group), who gets the directory; None when the job
            runs as the daemon's own user (nothing is given away).

    Returns:
        a descriptor open for appending (the caller closes it); the file is a regular file with
        one link, owned by root or ``uid``.

    Raises:
        UnsafeJobFile: the directory is a symlink, or the entry kept being replaced by
            something that is not a plain file.
        OSError: the directory cannot be created or opened.
    """
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"{name!r} is not a plain file name")
    os.makedirs(directory, exist_ok=True)
    try:
        dfd = os.open(directory, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeJobFile(exc.errno, f"{directory} is not a plain directory (a symlink?); "
                                "remove it and restart the job") from exc
        raise
    try:
        if uid is not None:
            st = os.fstat(dfd)
            if (st.st_uid, st.st_gid) != (uid, gid if gid != -1 else st.st_gid):
                os.fchown(dfd, uid, gid)
        owners = {os.geteuid(), 0} | ({uid} if uid is not None else set())
        for _ in range(_ATTEMPTS):
            fd = _open_plain(dfd, name, owners)
            if fd is not None:
                return fd
            log.warning("%s/%s was not a plain file of the job's (a symlink, FIFO or hard "
                        "link planted there?): removed, not followed", directory, name)
            try:
                os.unlink(name, dir_fd=dfd)  # unlinkat: removes the entry, follows nothing
            except FileNotFoundError:
                pass
            except OSError as exc:  # a directory planted under the name
                raise UnsafeJobFile(exc.errno, f"{directory}/{name} is not a file and cannot "
                                    f"be removed ({exc.strerror}); remove it") from exc
        raise UnsafeJobFile(errno.EPERM, f"{directory}/{name} keeps being replaced by something "
                            "that is not a plain file; refusing to open it")
    finally:
        os.close(dfd)


def _open_plain(dfd: int, name: str, owners: set[int]) -> int | None:
    """The entry opened for appending, created if missing; None if it is not a plain file."""
    try:
        fd = os.open(name, _APPEND_FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        try:
            fd = os.open(name, _APPEND_FLAGS | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
        except FileExistsError:
            return None  # raced with a new entry: look again
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EACCES, errno.EPERM):
            return None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid not in owners:
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return fd
