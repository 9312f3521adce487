"""The cluster secret file is checked before use: one clear line per problem, exit 2 at start.

Anyone who reads the secret can join the replication cluster and forge replicas, and anyone
who can test guesses needs a short secret only, so the daemon refuses a file that group or
others can access, a directory, a file owned by another user, and a secret under 128 bits.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elasticd.config import ConfigError, load

GOOD = "4f1c0b7e9a2d4c6e8f0a1b3c5d7e9f21"  # 32 characters


def secret_file(tmp_path, text: str = GOOD, mode: int = 0o600):
    path = tmp_path / "cluster-secret"
    path.write_text(text + "\n")
    os.chmod(path, mode)
    return str(path)


def test_a_private_file_with_a_long_secret_is_accepted(tmp_path):
    settings = load({"cluster_secret_file": secret_file(tmp_path)}, None, {})
    assert settings.secret == GOOD.encode()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_file_group_or_others_can_access_is_refused(tmp_path, mode):
    with pytest.raises(ConfigError) as exc:
        load({"cluster_secret_file": secret_file(tmp_path, mode=mode)}, None, {})
    assert f"mode {mode:04o}" in str(exc.value) and "chmod 600" in str(exc.value)


def test_a_directory_is_refused_as_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load({"cluster_secret_file": str(tmp_path)}, None, {})


def test_a_secret_under_128_bits_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="120 bits, fewer than 128"):
        load({"cluster_secret_file": secret_file(tmp_path, "x" * 15)}, None, {})
    with pytest.raises(ConfigError, match="cluster_secret .*fewer than 128"):
        load({}, None, {"ELASTICD_CLUSTER_SECRET": "y" * 15})


def test_a_file_owned_by_another_user_is_refused(tmp_path):
    # CI runs as root, which may give the file away; another user could rewrite it.
    path = secret_file(tmp_path)
    os.chown(path, 65534, 65534)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        load({"cluster_secret_file": path}, None, {})


def test_the_daemon_exits_2_with_one_line(tmp_path):
    for bad, needle in ((secret_file(tmp_path, mode=0o644), "chmod 600"),
                        (str(tmp_path), "is a directory")):
        res = subprocess.run([sys.executable, "-m", "elasticd.daemon.main", "--etcd",
                              "127.0.0.1:1", "--cluster-secret-file", bad],
                             capture_output=True, text=True, timeout=30)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1, res.stderr
        assert "cluster_secret_file" in lines[0] and needle in lines[0]
