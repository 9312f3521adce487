"""A benchmark's module, loaded by a test as a benchmark run has it: ``bench/`` on
``sys.path`` while it loads (its siblings import by name), and in ``sys.modules`` under its name
(as an import leaves it: dataclasses look their module up there)."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def load(name: str) -> ModuleType:
    """Loads ``bench/<name>.py`` afresh."""
    sys.path.insert(0, BENCH)
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, name + ".py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(BENCH)
