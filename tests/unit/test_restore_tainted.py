"""A restore whose direct fetch failed after landing rows in the live state (a holder lost
mid-fetch with no other to finish, a block failing its tag: elasticd/worker/direct.py) must
not end in a fresh start on that state: when no step then loads, the attempt fails on every
rank (the agent starts fresh processes) instead of training on a mix of two states."""

from __future__ import annotations

import time

import pytest
import torch

from elasticd.worker.restore import RestoreError, Solo, restore
from elasticd.worker.sources import Sources


class _Fails(Sources):
    """Sources whose one step cannot be fetched; ``landed``: the failed fetch had landed rows
    in the live state (as :class:`~elasticd.worker.direct.DirectFetch` marks it)."""

    def __init__(self, landed: bool) -> None:
        super().__init__(None, "job", 0, 1)
        self.landed = landed

    def discover(self):
        self.ram = {(0, 5)}
        return [(0, 5)]

    def fetch(self, version, refused, world=None, state=None):
        refused.append(f"direct fetch of step {version}: every holder failed")
        self.tainted = self.tainted or self.landed
        return None


@pytest.mark.parametrize("landed", [True, False], ids=["rows landed", "nothing landed"])
def test_no_step_loaded_after_a_failed_direct_fetch_fails_the_attempt(landed):
    state = {"model": torch.nn.Linear(2, 2)}
    sources = _Fails(landed)
    if landed:
        with pytest.raises(RestoreError, match="a failed fetch had written part of one"):
            restore(state, sources, Solo(), time.monotonic)
    else:  # the script's own start state is untouched: a fresh start, as before
        result = restore(state, sources, Solo(), time.monotonic)
        assert result.source == "none" and result.step == 0
        assert result.refused == ["direct fetch of step (0, 5): every holder failed"]
