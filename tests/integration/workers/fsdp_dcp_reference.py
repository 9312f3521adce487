"""The reference a resharded restore must equal: ``dcp.load`` of a DCP checkpoint (written by
tests/integration/workers/fsdp_trainer.py with ``dcp.save(get_state_dict(model, optim))``) into
the same FSDP2 model and Adam at this process group's world size, the standard way
(``get_state_dict``, ``dcp.load``, ``set_state_dict``); each rank then dumps its local shards as
the trainer dumps what it restored (``fsdp_trainer.local_state``).

Run one process per rank with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set:
``python fsdp_dcp_reference.py CHECKPOINT_DIR OUT_PREFIX`` writes ``OUT_PREFIX-rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_trainer import local_state, make_model, make_optimizer  # noqa: E402


def main() -> int:
    checkpoint, out = sys.argv[1], sys.argv[2]
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        model = make_model()
        opt = make_optimizer(model)
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=checkpoint)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
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
