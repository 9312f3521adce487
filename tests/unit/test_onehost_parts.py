"""``python -m elasticd.onehost`` without a cluster: bad input is one line and exit status, and
nothing is started (the commands with a cluster: tests/integration/test_onehost.py)."""

from __future__ import annotations

import os

import pytest

from elasticd import onehost


def test_a_gpu_set_per_node():
    assert onehost.gpu_sets("0,1:2,3", 2) == ["0,1", "2,3"]
    assert onehost.gpu_sets("7", 1) == ["7"]
    for bad, nodes in (("0,1:2,3", 3), ("0,1;2,3", 2), ("a:b", 2), ("0,,1:2", 2), ("", 1)):
        with pytest.raises(onehost.OneHostError, match="one comma-separated set of GPU"):
            onehost.gpu_sets(bad, nodes)


def test_commands_without_a_cluster_say_how_to_start_one(tmp_path, capsys):
    d = str(tmp_path / "none")
    for argv in (["env"], ["kill", "n2"], ["start", "n2"], ["down"]):
        assert onehost.main([*argv, "--dir", d]) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "no cluster is up" in err and "up --nodes 3" in err
    assert not os.path.exists(d)


def test_a_bad_gpu_spec_starts_nothing(tmp_path, capsys):
    d = str(tmp_path / "c")
    assert onehost.main(["up", "--nodes", "2", "--gpus", "0,1", "--dir", d]) == 1
    assert "2 nodes: e.g. 0,1:2,3" in capsys.readouterr().err
    assert not os.path.exists(d)


def test_the_default_directory_follows_tmpdir(monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert onehost.default_dir() == os.path.join(str(tmp_path), f"elasticd-onehost-{os.getuid()}")
