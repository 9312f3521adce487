"""Which elasticd tree a bench measured, recorded in its result and checked in every process.

An A/B of two trees runs the same bench with each tree first on ``PYTHONPATH``. Whatever
else is on ``sys.path`` ahead of it (the current directory, when a process starts with ``-c``
or ``-m`` from inside a worktree; an editable install's path) silently measures another tree,
and nothing in the figures shows it. So a bench drops the current directory from the path
when it starts (:func:`pin`; a spawned process inherits the parent's path), writes the
elasticd it imported into its result (:func:`describe`), and each spawned process checks
that it imported the very same one (:func:`check`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any


def pin() -> None:
    """Drops ``''`` and the current directory from ``sys.path`` (call it before elasticd is
    imported), unless the current directory is bench/ itself (whose modules import each
    other by name) or a directory ``PYTHONPATH`` names: a copy run from inside itself with
    ``PYTHONPATH`` set to it keeps it (dropping it too fell back to the worktree's editable
    install, and both arms of an A/B measured one tree: bench/results/restore31/)."""
    here, cwd = os.path.dirname(os.path.abspath(__file__)), os.getcwd()
    named = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    sys.path[:] = [p for p in sys.path if p != "" and (
        os.path.abspath(p) != cwd or cwd == here or os.path.abspath(p) in named)]


def package_dir() -> str:
    """The directory of the elasticd package this process imported."""
    import elasticd

    return os.path.dirname(os.path.abspath(elasticd.__file__))


def describe() -> dict[str, Any]:
    """The elasticd measured: its directory and, when that is in a git work tree, the
    commit and whether the tree's elasticd/ differs from it."""
    where = package_dir()
    out: dict[str, Any] = {"elasticd": where}
    try:
        top = subprocess.run(["git", "-C", where, "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, timeout=10, check=True)
        root, commit = top.stdout.split()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", where],
                               capture_output=True, text=True, timeout=10, check=True)
        out.update(commit=commit, modified=bool(dirty.stdout.strip()))
    except (OSError, ValueError, subprocess.SubprocessError):
        out["commit"] = None  # a copy (git archive) on PYTHONPATH: its directory names it
    return out


def check(expected: str) -> None:
    """Raises when this process imported another elasticd than ``expected`` (a directory
    :func:`package_dir` gave in the parent)."""
    got = package_dir()
    if got != expected:
        raise RuntimeError(f"this process imported elasticd from {got}, the bench's parent "
                           f"from {expected}: an A/B would measure the wrong tree")
