"""The injected clock: ``wait`` on the real and the fake clock, and that no module but
``elasticd/clock.py`` imports ``time`` (so every wait and deadline can be driven by a fake)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import elasticd
from elasticd.clock import SYSTEM_CLOCK, SystemClock, format_local
from elasticd.testing.clock import FakeClock

PACKAGE = pathlib.Path(elasticd.__file__).parent

#: Modules still allowed to import ``time``. Shrink it as each lands its injected clock (an entry
#: that no longer imports time fails the test, so the list cannot outlive its reason).
ALLOWED = {
    "clock.py",
}


def _imports_time(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(a.name == "time" or a.name.startswith("time.") for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "time":
            lines.append(node.lineno)
    return lines


def test_the_check_sees_every_form_of_import():
    forms = ["import time", "import time as t", "import os, time", "from time import sleep",
             "from time import monotonic as now", "def f():\n    import time"]
    for src in forms:
        assert _imports_time(ast.parse(src)), src
    for src in ["import datetime", "from elasticd import time_util", "from .time import x",
                "import timeit"]:
        assert not _imports_time(ast.parse(src)), src


def test_no_module_but_clock_imports_time():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 50  # the package was found
    found, importing = {}, set()
    for path in modules:
        name = path.relative_to(PACKAGE).as_posix()
        lines = _imports_time(ast.parse(path.read_text(), str(path)))
        if lines:
            importing.add(name)
            if name not in ALLOWED:
                found[name] = lines
    assert not found, (f"these modules import time: {found}; take a Clock (elasticd/clock.py) "
                       "instead, or SYSTEM_CLOCK where nothing injects one")
    assert ALLOWED <= importing, f"no longer import time: remove {ALLOWED - importing} from ALLOWED"


def test_fake_wait_advances_fake_time_to_the_timeout():
    clock = FakeClock()
    start = clock.monotonic()
    assert clock.wait(lambda: False, 30.0, interval=0.5) is False
    assert clock.monotonic() == start + 30.0


def test_fake_wait_stops_when_the_condition_holds():
    clock = FakeClock()
    start = clock.monotonic()
    assert clock.wait(lambda: clock.monotonic() >= start + 2.0, 30.0, interval=0.5) is True
    assert clock.monotonic() == start + 2.0
    assert clock.wait(lambda: True, 30.0) is True and clock.monotonic() == start + 2.0


def test_fake_wait_uses_an_overridden_sleep():
    slept = []

    class Recording(FakeClock):
        def sleep(self, seconds):
            slept.append(seconds)
            super().sleep(seconds)

    assert Recording().wait(lambda: False, 1.0, interval=0.4) is False
    assert slept[:2] == [0.4, 0.4] and sum(slept) == pytest.approx(1.0)


def test_fake_clock_reads():
    clock = FakeClock(start=5.0, wall_offset=100.0)
    clock.advance(1.5)
    assert (clock.monotonic(), clock.perf_counter(), clock.wall()) == (6.5, 6.5, 106.5)
    clock.sleep(-3)  # a negative sleep does not move time back
    assert clock.monotonic() == 6.5


def test_real_wait_polls_until_the_condition_holds():
    clock = SystemClock()
    calls = []
    assert clock.wait(lambda: calls.append(1) or len(calls) >= 3, 5.0, interval=0.01) is True
    assert len(calls) == 3
    start = clock.monotonic()
    assert clock.wait(lambda: False, 0.05, interval=0.01) is False
    assert clock.monotonic() - start >= 0.05


def test_format_local():
    assert format_local(0.0, "%Y") in ("1969", "1970")
    assert len(format_local(SYSTEM_CLOCK.wall())) == len("2026-01-01T00:00:00")
