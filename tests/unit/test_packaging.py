"""The package metadata builds without warnings of ours: setuptools deprecated the license as a
TOML table (``license = { text = ... }``) and printed pages of warnings on every install."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BUILD = ("import sys; from setuptools import build_meta as b; "
         "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")


def test_metadata_builds_without_warnings_and_declares_the_license(tmp_path):
    res = subprocess.run([sys.executable, "-W", "always", "-c", BUILD, str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    assert "Warning" not in out and "deprecat" not in out.lower(), out
    dist_info = res.stdout.strip().splitlines()[-1]
    with open(os.path.join(tmp_path, dist_info, "METADATA")) as fh:
        metadata = fh.read()
    assert "License-Expression: Apache-2.0" in metadata, metadata[:600]
