"""Files a job user or an etcd writer chose, read without being held by them (issue 26,
findings 1, 2 and 8; the same against real daemons: tests/integration/test_daemon_not_blocked.py).

Each check works on a descriptor: the file system from the mount table and ``fstatfs``, the
type, the owner, the size; then at most ``st_size`` bytes are read. Directories of the job's
user are listed without following a link and at most :data:`MAX_ENTRIES` names at a time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from elasticd.agent import crashloop, safe_open
from elasticd.agent.supervisor import ENV_READ_LIMIT, TAG_ENV, tagged_pids
from tests.hostile_files import HUGE_ENVIRONMENT, hung_fuse, sparse_file


def _open(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)


@pytest.mark.parametrize("path,needle", [
    ("/proc/self/pagemap", "on a proc file system"),
    ("/proc/self/environ", "on a proc file system"),
    ("/sys/kernel/mm/transparent_hugepage/enabled", "on a sysfs file system"),
    ("/dev/zero", "on a devtmpfs file system"),
])
def test_pseudo_file_systems_are_refused_on_the_descriptor(path, needle):
    if not os.path.exists(path):
        pytest.skip(f"{path} is not on this machine")
    fd = _open(path)
    try:
        with pytest.raises(safe_open.UnsafeFile, match=needle):
            safe_open.check_file(fd, path, 1 << 20)
    finally:
        os.close(fd)


def test_type_owner_and_size_are_checked_on_the_descriptor(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    fd = _open(fifo)  # O_NONBLOCK: a FIFO opens at once for reading
    try:
        with pytest.raises(safe_open.UnsafeFile, match="is a FIFO, not a regular file"):
            safe_open.check_file(fd, "fifo", 1 << 20)
    finally:
        os.close(fd)
    huge = sparse_file(str(tmp_path / "huge"), 1 << 40)
    empty = sparse_file(str(tmp_path / "empty"), 0)
    theirs = tmp_path / "theirs"
    theirs.write_text("print('x')\n")
    os.chown(theirs, 54321, 54321)
    for path, kw, needle in ((huge, {}, "1099511627776 bytes, more than"),
                             (empty, {}, r"is empty \(size 0\)"),
                             (str(theirs), {"owners": {0}}, "belongs to uid 54321")):
        fd = _open(path)
        try:
            with pytest.raises(safe_open.UnsafeFile, match=needle):
                safe_open.check_file(fd, path, 1 << 20, **kw)
        finally:
            os.close(fd)
    fd = _open(str(theirs))
    try:
        assert safe_open.check_file(fd, "theirs", 1 << 20, owners={54321}).st_size == 11
    finally:
        os.close(fd)


def test_at_most_st_size_bytes_are_read_whatever_the_file_does(tmp_path):
    path = tmp_path / "grows"
    path.write_bytes(b"a" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        with open(path, "ab") as fh:
            fh.write(b"b" * 1000)  # grows after the size was taken
        assert b"".join(safe_open.read_bounded(fd, 100)) == b"a" * 100
        assert safe_open.sha256_of(fd, 100) == __import__("hashlib").sha256(b"a" * 100).hexdigest()
        assert safe_open.read_tail(fd, 1095, 4096) == b"b" * 5
        assert safe_open.read_tail(fd, 0, 3) == b"bbb"
    finally:
        os.close(fd)


def test_a_hung_fuse_mount_is_named_by_the_mount_table_without_asking_it(tmp_path):
    """A file system whose server does not answer: its mount is found in the mount table
    (which asks the file system nothing), and a directory below it is not opened."""
    mnt = str(tmp_path / "mnt")
    with hung_fuse(mnt):
        assert safe_open.mounts_under(str(tmp_path)) == [mnt]
        started = time.monotonic()
        with safe_open.open_dir(mnt) as fd:
            assert fd == -1
        assert crashloop.attempts(mnt, set()) == -1
        assert time.monotonic() - started < 1.0


def test_the_job_users_directories_are_listed_without_following_links(tmp_path):
    """torchrun's log directory belongs to the job's user: a link there (to a hung mount, to a
    directory of millions of names) is not followed, and a listing is bounded."""
    torchrun = tmp_path / "torchrun"
    (torchrun / "run_a" / "attempt_3").mkdir(parents=True)
    (tmp_path / "elsewhere" / "attempt_9").mkdir(parents=True)
    os.symlink(tmp_path / "elsewhere", torchrun / "run_b")
    assert crashloop.attempts(str(torchrun), set()) == 3  # run_b, a link, is not read
    os.rename(torchrun, tmp_path / "torchrun.real")
    os.symlink(tmp_path / "torchrun.real", torchrun)
    assert crashloop.attempts(str(torchrun), set()) == -1 and crashloop.runs(str(torchrun)) == set()
    many = tmp_path / "many"
    many.mkdir()
    for i in range(safe_open.MAX_ENTRIES + 10):
        (many / f"d{i}").touch()
    with safe_open.open_dir(str(many)) as fd:
        assert len(safe_open.list_dir(fd)) == safe_open.MAX_ENTRIES


def _rchar() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


def test_looking_for_tagged_processes_reads_the_head_of_each_environment():
    """Any local user can make its environment gigabytes of empty memory: the scan that finds a
    job's processes (every stop) reads a bounded head of each, and finds its own by the tag
    the daemon puts first."""
    size = 1 << 30  # 64 GiB holds a whole read ~30 s; 1 GiB keeps the old code's cost small
    hostile = subprocess.Popen(
        [sys.executable, "-c", HUGE_ENVIRONMENT + "\nimport sys; print('ready', flush=True); "
         "sys.stdin.read()"], env={**os.environ, "ENVIRON_BYTES": str(size),
                                   TAG_ENV: "elsewhere"},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tagged = subprocess.Popen(["sleep", "30"], env={TAG_ENV: "t:mine",
                                                         **{f"PAD{i}": "x" * 60_000 for i in range(4)}})
    try:
        assert hostile.stdout.readline().strip() == "ready"
        before = _rchar()
        assert tagged_pids("t:mine") == [tagged.pid]
        assert _rchar() - before < 64 * ENV_READ_LIMIT + (8 << 20)
    finally:
        for proc in (hostile, tagged):
            proc.kill()
            proc.wait()
