"""The step a worker's live training state still is, so that a survivor kept in-process
(``@elasticd.in_process``) does not load from its node's RAM the bytes its memory already holds
(issue 31: the load and its two collectives were ~25 ms of a ~140 ms re-formation).

What a :func:`mark` records (the optimizer steps the
:class:`~elasticd.worker.optimizer_fence.OptimizerFence` counts, each tensor's storage and
autograd version counter, the layout, the meta), which states get one and when the restore
takes the fast path: docs/in-process-design.md §4.5, "A survivor whose memory already is the
step loads nothing". Worker side: imports torch through its callers' objects only.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from elasticd.worker.snapshot_plan import meta_json
from elasticd.worker.sources import Version, sharded
from elasticd.worker.state import FlatState


@dataclasses.dataclass(frozen=True)
class Held:
    """The live state is snapshot ``version`` while its mark is ``mark``."""

    version: Version
    mark: tuple


def mark(flat: FlatState, optimizer_steps: int, mask: Sequence[bool]) -> tuple | None:
    """What identifies ``flat``'s current contents without reading them; None when the state
    cannot be vouched for that way (``mask``: :func:`sync_mask`, True for a tensor something
    besides ``optimizer.step`` may change; or sharded)."""
    if any(mask) or sharded(flat.meta):
        return None
    return (optimizer_steps, flat.key(),
            tuple((t.data_ptr(), t._version) for t in flat.tensors), meta_json(flat.meta))


def still(held: Held | None, now: tuple | None) -> Version | None:
    """The version the live state still is (its mark ``now``), or None."""
    if held is None or now is None or held.mark != now:
        return None
    return held.version
