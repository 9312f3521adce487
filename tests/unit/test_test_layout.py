"""The suite's own layout: ``tests/unit`` and ``tests/integration`` are not packages, so pytest
imports their modules by basename, and two test files of one name stop the whole suite at
collection ("import file mismatch"). That stopped a CI run once, after each directory had passed
on its own; this check fails in either directory's run."""

from __future__ import annotations

import collections
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_modules_outside_packages_have_distinct_basenames():
    seen = collections.defaultdict(list)
    for root, dirs, files in os.walk(TESTS):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if os.path.exists(os.path.join(root, "__init__.py")):
            continue  # a package's modules are imported by their dotted name
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                seen[name].append(os.path.relpath(os.path.join(root, name), TESTS))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a basename outside packages: {clashes}"
