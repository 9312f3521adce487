"""tests/ranks.py: spawned ranks leave nothing in the temporary directory, though they end by
``os._exit`` (which skips multiprocessing's clean-up of its pymp-* directory)."""

from __future__ import annotations

import os
import tempfile

from tests.ranks import spawn


def _makes_pymp(rank: int) -> None:
    from multiprocessing import util
    util.get_temp_dir()  # what sharing a descriptor through multiprocessing makes


def test_ranks_leave_no_pymp_directory_behind():
    def pymp() -> set[str]:
        return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith(("pymp-", "ranks-"))}

    before = pymp()
    spawn(_makes_pymp, (), 2)
    assert pymp() == before
