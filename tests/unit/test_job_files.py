"""What the job's user may plant in its log directory: the daemon follows none of it (issue 13,
finding 1; with a real agent: tests/integration/test_job_user_isolation.py)."""

from __future__ import annotations

import os
import stat

import pytest

from elasticd.agent.job_files import UnsafeJobFile, open_job_log


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "root-only"
    path.write_text("secret\n")
    path.chmod(0o600)
    return path


def _append(directory, text: bytes = b"banner\n") -> None:
    fd = open_job_log(str(directory), "agent.log", None)
    try:
        os.write(fd, text)
    finally:
        os.close(fd)


@pytest.mark.parametrize("plant", ["symlink", "hardlink", "fifo"])
def test_a_planted_entry_is_replaced_not_followed(tmp_path, victim, plant):
    logs = tmp_path / "jobs" / "j"
    logs.mkdir(parents=True)
    entry = logs / "agent.log"
    if plant == "symlink":
        entry.symlink_to(victim)
    elif plant == "hardlink":
        os.link(victim, entry)
    else:
        os.mkfifo(entry)
    _append(logs)
    assert victim.read_text() == "secret\n"
    st = os.lstat(entry)
    assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and entry.read_bytes() == b"banner\n"


def test_an_existing_log_is_appended_to(tmp_path):
    logs = tmp_path / "j"
    _append(logs, b"one\n")
    _append(logs, b"two\n")
    assert (logs / "agent.log").read_bytes() == b"one\ntwo\n"


def test_a_symlinked_directory_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "j").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeJobFile, match="not a plain directory"):
        _append(tmp_path / "j")
    assert not (tmp_path / "elsewhere" / "agent.log").exists()


def test_a_directory_under_the_name_is_a_clear_error(tmp_path):
    (tmp_path / "j" / "agent.log").mkdir(parents=True)
    with pytest.raises(UnsafeJobFile, match="remove it"):
        _append(tmp_path / "j")
