"""Reading a file that a job user or an etcd writer chose, without being held by it.

The daemon runs as root, and its main loop and its local socket's accept thread keep the node in
the cluster: nothing a job user or an etcd writer controls may block either (docs/security.md).
A path such a party names, or a file in a directory such a party can write, may be anything:
``/proc/self/pagemap`` (a "regular file" of size 0 that reads for ever), a FIFO (``open()``
waits for a writer), a symlink swapped in after a check, a sparse file of a terabyte, a file
on a FUSE mount whose server never answers. So such a file is read here only through a
descriptor opened once, and only after these checks on that descriptor:

* its file system, first from the mount table (:func:`mount_fs_type`: the kernel's record of
  the descriptor's mount, which asks nothing of the file system itself, so a FUSE server that
  never answers cannot hold the check), then from ``fstatfs``: procfs, sysfs, devtmpfs, FUSE
  and the other pseudo file systems are refused;
* its type (a regular file), its owner (when the caller names who may own it), its size (0
  is refused: a procfs or sysfs file reports 0; above a cap is refused);
* then at most ``st_size`` bytes are read, with ``pread``, from that descriptor.

The path itself is opened by whoever may read it: a job's files by a helper running as the job's
user (:mod:`elasticd.agent.open_as`), which passes the descriptor back; the checks that may take
time run off the main loop with a deadline (:mod:`elasticd.agent.job_check`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import stat
from typing import Iterator

from elasticd.errors import NodeError

#: The largest training script a daemon hashes (a script is source code: megabytes at most).
MAX_SCRIPT_BYTES = 16 << 20

#: File systems whose files are no job's files (names as /proc/self/mountinfo gives them; a
#: ``fuse.<name>`` subtype counts as fuse).
REFUSED_FS_TYPES = frozenset({
    "proc", "sysfs", "devtmpfs", "fuse", "fuseblk", "fusectl", "debugfs", "tracefs",
    "securityfs", "configfs", "cgroup", "cgroup2", "bpf", "pstore", "efivarfs", "devpts",
    "mqueue", "binfmt_misc", "autofs", "rpc_pipefs", "nsfs", "selinuxfs"})

#: The same file systems by ``statfs`` magic (linux/magic.h). devtmpfs reports tmpfs's magic:
#: the mount table above is what tells it apart.
_REFUSED_MAGIC = {
    0x9FA0: "proc", 0x62656572: "sysfs", 0x65735546: "fuse", 0x65735543: "fusectl",
    0x64626720: "debugfs", 0x74726163: "tracefs", 0x73636673: "securityfs",
    0x62656570: "configfs", 0x27E0EB: "cgroup", 0x63677270: "cgroup2", 0xCAFE4A11: "bpf",
    0x6165676C: "pstore", 0xDE5E81E4: "efivarfs", 0x1CD1: "devpts", 0x19800202: "mqueue",
    0x42494E4D: "binfmt_misc", 0x0187: "autofs", 0x6E736673: "nsfs", 0xF97CFF8C: "selinuxfs"}

#: Entries read from one of a job user's directories at most: a directory filled with millions
#: of names costs the daemon no more than this.
MAX_ENTRIES = 4096

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"))


class UnsafeFile(NodeError):
    """A file refused before anything was read from it; the message says why, on one line."""


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a FIFO", "a regular file")."""
    return next((name for test, name in _KINDS if test(mode)), "a regular file"
                if stat.S_ISREG(mode) else "not a regular file")


def mount_fs_type(fd: int) -> str:
    """The file system type of ``fd``'s mount, from this process's mount table; "" if unknown.

    Reads only ``/proc/self``: the descriptor's mount id (``fdinfo``) and the mount table,
    which the kernel answers without asking the file system (a hung FUSE server included).
    """
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as fh:
            info = fh.read(4096)
        mnt_id = next(line.split(b":", 1)[1].strip() for line in info.splitlines()
                      if line.startswith(b"mnt_id:"))
        with open("/proc/self/mountinfo", "rb") as fh:
            for line in fh:
                head, sep, tail = line.partition(b" - ")
                if sep and head.split(b" ", 1)[0] == mnt_id:
                    return tail.split(b" ", 1)[0].decode(errors="replace")
    except (OSError, StopIteration, IndexError):
        pass
    return ""


_libc = None


def fs_magic(fd: int) -> int | None:
    """``fstatfs(fd).f_type`` (None when it cannot be had). Python has no ``fstatfs``; the
    field is the first of ``struct statfs`` on every Linux ABI."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)
    if _libc.fstatfs(fd, buf) != 0:
        return None
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def check_file(fd: int, what: str, max_bytes: int,
               owners: set[int] | None = None) -> os.stat_result:
    """Checks the file open at ``fd`` before anything is read from it (module docstring).

    Args:
        what: how the file is named in the refusal ("script '/opt/train.py'").
        owners: the uids that may own it (None: any).

    Raises:
        UnsafeFile: refused, with the reason.
    """
    fstype = mount_fs_type(fd)
    if fstype in REFUSED_FS_TYPES or fstype.startswith("fuse."):
        raise UnsafeFile(f"{what} is on a {fstype} file system, which no job's file may be on")
    magic = fs_magic(fd)
    if magic in _REFUSED_MAGIC:
        raise UnsafeFile(f"{what} is on a {_REFUSED_MAGIC[magic]} file system, which no job's "
                         "file may be on")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{what} is {kind_of(st.st_mode)}, not a regular file")
    if owners is not None and st.st_uid not in owners:
        raise UnsafeFile(f"{what} belongs to uid {st.st_uid}: only root or the job's user may "
                         "own it (another user could change what the job runs)")
    if st.st_size == 0:
        raise UnsafeFile(f"{what} is empty (size 0)")
    if st.st_size > max_bytes:
        raise UnsafeFile(f"{what} is {st.st_size} bytes, more than the {max_bytes} a daemon "
                         "reads")
    return st


def read_bounded(fd: int, size: int, offset: int = 0, chunk: int = 1 << 20):
    """Yields the ``size`` bytes of ``fd`` from ``offset`` (fewer if it is shorter), read with
    ``pread``: never more than ``size``, whatever the file does meanwhile."""
    end = offset + size
    while offset < end:
        data = os.pread(fd, min(chunk, end - offset), offset)
        if not data:
            return
        offset += len(data)
        yield data


def sha256_of(fd: int, size: int) -> str:
    """The SHA-256 of the first ``size`` bytes of ``fd`` (:func:`read_bounded`)."""
    h = hashlib.sha256()
    for data in read_bounded(fd, size):
        h.update(data)
    return h.hexdigest()


def read_tail(fd: int, start: int, limit: int) -> bytes:
    """What ``fd`` holds from ``start`` on, at most its last ``limit`` bytes (b"" if nothing or
    unreadable); the size is the descriptor's, taken once."""
    try:
        size = os.fstat(fd).st_size
        begin = max(start, size - limit, 0)
        return b"".join(read_bounded(fd, max(0, size - begin), begin))
    except OSError:
        return b""


def mounts_under(path: str) -> list[str]:
    """Mount points at or below ``path`` (from this process's mount table, which asks no file
    system anything). A job user who may mount (FUSE through a setuid ``fusermount``) could
    put one in a directory of its own; what is below it is not read on the main loop."""
    path = os.path.normpath(path)
    found = []
    try:
        with open("/proc/self/mountinfo", "rb") as fh:
            for line in fh:
                fields = line.split(b" ")
                if len(fields) > 4:
                    point = _unescape(fields[4])
                    if point == path or point.startswith(path.rstrip("/") + "/"):
                        found.append(point)
    except OSError:
        pass
    return found


def _unescape(raw: bytes) -> str:
    """A mountinfo path: spaces, tabs, newlines and backslashes come octal-escaped."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)),
                  raw.decode(errors="replace"))


@contextlib.contextmanager
def open_dir(name: str, dir_fd: int | None = None) -> Iterator[int]:
    """A directory of a job user's, opened without following a link at ``name``'s last
    component (relative to ``dir_fd`` when given); -1 when it is missing, a link, not a
    directory, or has a file system mounted at or below it (:func:`mounts_under`: opening a
    FUSE mount's root asks its server). Closed on exit."""
    fd = -1
    try:
        if dir_fd is None and mounts_under(name):
            yield -1
            return
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        yield -1
        return
    try:
        yield fd
    finally:
        os.close(fd)


def list_dir(fd: int) -> list[str]:
    """Up to :data:`MAX_ENTRIES` names in the directory open at ``fd`` ([] for -1)."""
    if fd < 0:
        return []
    try:
        with os.scandir(fd) as it:  # reads a duplicate, rewound on close
            return [e.name for e, _ in zip(it, range(MAX_ENTRIES))]
    except OSError:
        return []
