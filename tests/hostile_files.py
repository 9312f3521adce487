"""What a job user, another local user or an etcd writer can put where the root daemon looks:
the test doubles of docs/security.md's rule that nothing they control blocks the daemon.

* :func:`hung_fuse`: a FUSE mount whose server never answers (any lookup below it waits until
  the mount goes): what a user who may mount FUSE (``fusermount``) can leave anywhere;
* :data:`HUGE_ENVIRONMENT`: a Python prelude that points the process's environment, as
  ``/proc/<pid>/environ`` shows it, at gigabytes of never-touched memory
  (``prctl(PR_SET_MM_MAP)``, allowed to any user): reading it whole takes minutes and as much
  memory;
* :func:`sparse_file`: a file of any size that takes no disk.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Iterator

import pytest

# Run first in a child (before anything else it does): ``ENVIRON_BYTES`` from its environment
# is the size. Linux x86-64/arm64; struct prctl_mm_map (linux/prctl.h), fields from
# /proc/self/stat.
HUGE_ENVIRONMENT = r"""
import ctypes, os, struct
_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.sbrk.restype = ctypes.c_void_p
_libc.sbrk.argtypes = [ctypes.c_long]
_size = int(os.environ["ENVIRON_BYTES"])
_addr = _libc.mmap(None, _size, 1, 0x22 | 0x4000, -1, 0)  # read-only, private, noreserve
_f = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
_g = lambda n: int(_f[n - 3])
_map = struct.pack("QQQQQQQQQQQQII", _g(26), _g(27), _g(45), _g(46), _g(47), _libc.sbrk(0),
                   _g(28), _g(48), _g(49), _addr, _addr + _size, 0, 0, 0xFFFFFFFF)
_buf = ctypes.create_string_buffer(_map, len(_map))
if _libc.prctl(35, 14, ctypes.addressof(_buf), len(_map), 0) != 0:  # PR_SET_MM, _MAP
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_MM_MAP)")
"""


def sparse_file(path: str, size: int) -> str:
    """A file of ``size`` bytes that holds no block, readable by everyone."""
    with open(path, "wb") as fh:
        fh.truncate(size)
    os.chmod(path, 0o644)
    return path


@contextlib.contextmanager
def hung_fuse(path: str) -> Iterator[str]:
    """Mounts at ``path`` a FUSE file system whose server never answers: ``path/anything``
    waits (killably) until the mount goes. Root only; skips the test otherwise, with why."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("a FUSE mount needs root and /dev/fuse (CI has both)")
    libc = ctypes.CDLL(None, use_errno=True)
    os.makedirs(path, exist_ok=True)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
    if libc.mount(b"elasticd-test-hung", path.encode(), b"fuse", ctypes.c_ulong(2 | 4),
                  opts) != 0:  # MS_NOSUID | MS_NODEV
        err = ctypes.get_errno()
        os.close(fd)
        pytest.skip(f"cannot mount FUSE here: {os.strerror(err)}")
    try:
        yield path
    finally:
        libc.umount2(path.encode(), 2)  # MNT_DETACH: whoever waits below gets ENOTCONN
        os.close(fd)  # aborts the connection
