"""A local cluster's jobs write their temporary files in a directory of the cluster's own,
removed at stop: a killed worker's leftovers (multiprocessing's pymp-* directories, a
half-made probe file of tempfile's) used to stay in /tmp after a passing test run."""

from __future__ import annotations

import os
import stat

from elasticd.launcher import LocalCluster


def test_jobs_get_a_tmpdir_of_the_clusters_own_removed_at_stop(tmp_path):
    c = LocalCluster(["n1"], workdir=str(tmp_path))
    try:
        assert c.env["TMPDIR"] == c.tmp_dir  # the daemons' environment, which jobs inherit
        assert stat.S_IMODE(os.stat(c.tmp_dir).st_mode) == 0o1777  # the jobs' user writes there
        os.mkdir(os.path.join(c.tmp_dir, "pymp-left-by-a-killed-worker"))
        assert len(c.tmp_dir) < 40  # AF_UNIX paths made under it stay short
    finally:
        c.stop()
    assert not os.path.exists(c.tmp_dir)


def test_a_tmpdir_the_caller_gives_is_kept(tmp_path):
    c = LocalCluster(["n1"], workdir=str(tmp_path), env={"TMPDIR": str(tmp_path)})
    c.stop()
    assert c.tmp_dir is None and c.env["TMPDIR"] == str(tmp_path) and tmp_path.exists()
