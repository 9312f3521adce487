"""The reference a resharded ZeroRedundancyOptimizer restore must equal: the model's state
dict and the optimizer state consolidated by tests/integration/workers/zero_trainer.py
(``consolidate_state_dict(to=0)``, rank 0's ``state_dict()``), loaded at this process group's
world size the standard way (``model.load_state_dict``, ``ZeroRedundancyOptimizer
.load_state_dict``, which keeps each rank's partition); each rank then dumps its state as the
trainer dumps what it restored (``zero_trainer.local_state``).

Run one process per rank with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set:
``python zero_reference.py CHECKPOINT.pt OUT_PREFIX`` writes ``OUT_PREFIX-rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_trainer import local_state, make_model, make_optimizer  # noqa: E402


def main() -> int:
    checkpoint, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        model = make_model()
        opt = make_optimizer(model)
        saved = torch.load(checkpoint, weights_only=True)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        torch.save(local_state(model, opt) | {"world": dist.get_world_size()},
                   f"{out}-rank{dist.get_rank()}.pt")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # docs/facts.md: gloo can SIGABRT in teardown after destroy_process_group
