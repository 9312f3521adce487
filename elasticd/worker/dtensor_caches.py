"""DTensor's process-wide caches, emptied when an in-process worker leaves its round (issue 31).

torch 2.13's DTensor caches plans keyed and valued by specs that hold the round's
``DeviceMesh``, and so its group; a mesh's equality ignores its group, so a process's first
FSDP2 round stayed alive after its leave. Which caches held it, and the spike that shows it:
docs/jobs.md, "What kept a first FSDP2 round alive". Emptying them costs the next round a few
recomputed plans; a cached entry of a destroyed round is no use to it anyway.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys

log = logging.getLogger(__name__)

#: DTensor's caches that hold meshes: (module, the dotted path to the cache's clear function).
_CACHES = (
    ("torch._C", "_clear_DTensor_sharding_propagator_cache"),
    ("torch.distributed.tensor",
     "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear"),
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
)


def forget() -> int:
    """Empties DTensor's caches when DTensor is in use in this process (it is not imported
    here otherwise), and elasticd's layout caches of DTensors (:mod:`elasticd.worker.shards`,
    keyed the same way); returns how many of DTensor's were emptied. A cache a torch version
    does not have is skipped: the leave's socket check still tells if something else keeps
    the group."""
    shards = sys.modules.get("elasticd.worker.shards")
    if shards is not None:
        shards.forget_layouts()
    if "torch.distributed.tensor" not in sys.modules:
        return 0
    done = 0
    for module, path in _CACHES:
        try:
            functools.reduce(getattr, path.split("."), importlib.import_module(module))()
            done += 1
        except (AttributeError, ImportError) as exc:
            log.debug("a DTensor cache not emptied: %s", exc)
    return done
