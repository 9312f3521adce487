"""Test doubles live in ``elasticd/testing/`` and nowhere else in the package (issue 28).

A class named like a double (``Fake…``, ``Memory…``, ``Stub…``, ``Dummy…``, with or without a
leading underscore) defined anywhere else under ``elasticd/`` fails here: the product ships no
fakes beside its modules. That no product module imports ``elasticd.testing`` is an import
contract (``pyproject.toml``, ``tests/unit/test_import_contracts.py``).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "elasticd"
TESTING = PACKAGE / "testing"
PREFIXES = ("Fake", "Memory", "Stub", "Dummy")


def double_classes(source: str) -> list[str]:
    """Names of the classes in ``source`` (at any depth) named like a test double."""
    return [node.name for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and node.name.lstrip("_").startswith(PREFIXES)]


def test_the_check_sees_a_double_at_any_depth():
    src = ("class FakeClock: pass\n"
           "def f():\n    class _MemoryStore: pass\n"
           "class A:\n    class StubSink: pass\n"
           "class DummyX(object): pass\n"
           "class Memo: pass\nclass InMemoryThing: pass\n")
    assert double_classes(src) == ["FakeClock", "DummyX", "_MemoryStore", "StubSink"]


def test_the_doubles_are_where_the_tests_find_them():
    found = {p.name: double_classes(p.read_text()) for p in TESTING.glob("*.py")}
    assert "FakeClock" in found["clock.py"]
    assert {"MemoryStore", "MemoryCoordinator"} <= set(found["coordination.py"])
    assert "MemorySink" in found["replication.py"]


def test_no_test_double_outside_elasticd_testing():
    outside = {str(p.relative_to(ROOT)): names for p in PACKAGE.rglob("*.py")
               if TESTING not in p.parents and (names := double_classes(p.read_text()))}
    assert not outside, f"test doubles belong in elasticd/testing/: {outside}"
