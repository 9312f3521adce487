"""DTensor's process-wide caches, emptied when an in-process worker leaves its round (issue 31).

torch 2.13's DTensor caches plans keyed and valued by specs that hold the round's
``DeviceMesh``, and so its group; a mesh's equality ignores its group, so a process's first
FSDP2 round stayed alive after its leave. Which caches held it, and the spike that shows it:
docs/jobs.md, "What kept a first FSDP2 round alive". Emptying them costs the next round a few
recomputed plans; a cached entry of a destroyed round is no use to it anyway.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

log = logging.getLogger(__name__)


def forget() -> int:
    """Empties DTensor's caches when DTensor is in use in this process (it is not imported
    here otherwise), and elasticd's layout caches of DTensors (:mod:`elasticd.worker.shards`,
    keyed the same way); returns how many of DTensor's were emptied. A cache a torch version
    does not have is skipped: the leave's socket check still tells if something else keeps
    the group."""
    shards = sys.modules.get("elasticd.worker.shards")
    if shards is not None:  # elasticd's own layout caches, keyed the same way
        shards.forget_layouts()
    if "torch.distributed.tensor" not in sys.modules:
        return 0
    import torch

    done = 0
    for clear in _clears(torch):
        try:
            clear()
            done += 1
        except (AttributeError, ImportError) as exc:
            log.debug("a DTensor cache not emptied: %s", exc)
    return done


def _clears(torch: Any) -> tuple[Callable[[], None], ...]:
    def fast_path() -> None:
        torch._C._clear_DTensor_sharding_propagator_cache()

    def sharding() -> None:
        from torch.distributed.tensor import DTensor

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()

    def planners() -> None:
        from torch.distributed.tensor import _redistribute

        _redistribute.clear_redistribute_planner_cache()

    def transforms() -> None:
        from torch.distributed.tensor import _redistribute

        _redistribute._gen_transform_infos.cache_clear()

    def topology() -> None:
        from torch.distributed.tensor import _collective_utils

        _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()

    return fast_path, sharding, planners, transforms, topology
