"""An A/B of two elasticd trees measures the tree it names: a bench drops the current
directory from its path before importing elasticd, records the tree it imported, and a
process of the bench that imported another one stops (bench/code_tree.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.bench_modules import BENCH, load

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fake_tree(tmp_path) -> str:
    """A copy's stand-in on PYTHONPATH: an ``elasticd`` package that says where it is."""
    pkg = tmp_path / "copy" / "elasticd"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    return str(tmp_path / "copy")


def run_in_repo(code: str, pythonpath: str) -> str:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True,
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def test_started_from_the_worktree_the_copy_on_pythonpath_is_the_one_imported(tmp_path):
    copy = fake_tree(tmp_path)
    # Without the pin, a process started with -c from the worktree imports the worktree's
    # elasticd: '' comes before PYTHONPATH (the wrong tree, silently).
    plain = run_in_repo("import elasticd; print(elasticd.__file__)", copy)
    assert plain == os.path.join(REPO, "elasticd", "__init__.py")
    pinned = run_in_repo("import code_tree; code_tree.pin(); import elasticd, json; "
                         "print(json.dumps(code_tree.describe()))",
                         os.pathsep.join([BENCH, copy]))
    assert f'"elasticd": "{os.path.join(copy, "elasticd")}"' in pinned
    assert '"commit": null' in pinned  # a copy outside git: its directory names it


def test_run_from_inside_the_copy_on_pythonpath_the_copy_is_the_one_imported(tmp_path):
    """restore31's A/B ran each arm from inside its copy with PYTHONPATH set to it: the pin
    dropped the copy with the current directory, and elasticd came from the worktree's
    editable install (both arms measured one tree)."""
    copy = fake_tree(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([BENCH, copy])}
    out = subprocess.run([sys.executable, "-c", "import code_tree; code_tree.pin(); "
                          "import elasticd; print(elasticd.__file__)"], cwd=copy, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == os.path.join(copy, "elasticd", "__init__.py"), out.stderr[-300:]


def test_a_process_that_imported_another_tree_stops(tmp_path):
    code_tree = load("code_tree")
    here = code_tree.package_dir()
    code_tree.check(here)
    with pytest.raises(RuntimeError, match="wrong tree"):
        code_tree.check(fake_tree(tmp_path))
    described = code_tree.describe()
    assert described["elasticd"] == here and len(described["commit"] or "") == 40
