"""A tiny deterministic training job that checkpoints every step through elasticd.

Usage: ``torchrun ... ckpt_train.py OUT_DIR TOTAL_STEPS KILL_AT FAULT``. On the first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0) and at step KILL_AT (0: never), every rank waits for its
snapshot to be sealed and meets the others at a barrier; then rank 1 asks the test's daemon for
FAULT ("none", "drop": empty the job's RAM, "corrupt": flip payload bytes in its slots) and
kills itself with SIGKILL. Rank 0 fails in the next all_reduce and torchrun restarts both.
At the end each rank writes its model and optimizer state to OUT_DIR/final-rank<r>.safetensors.

Bitwise-exact resume (docs/facts.md): one thread, no dropout, a sampler whose position is in the
state, RNG states in the state, gradients averaged by explicit all_reduce (no DDP bucket
rebuild), and ``os._exit(0)`` after tearing down the process group.
"""

import logging
import os
import signal
import sys

import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F

import elasticd
from elasticd.worker.state import flatten


def main() -> None:
    out_dir, total, kill_at, fault = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the process group first, then data, then the model
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    g = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(96, 8, generator=g), torch.randn(96, 4, generator=g)
    dataset = torch.utils.data.TensorDataset(inputs, targets)
    sampler = elasticd.ElasticSampler(len(dataset), seed=5)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler,
                                         generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt, "sampler": sampler, "rng": elasticd.RNGState()}

    ckpt = elasticd.Checkpointer(every=1)
    step = ckpt.restore(state)
    r = ckpt.last_restore
    print(f"RESTORED rank={rank} attempt={attempt} step={step} source={r.source} "
          f"lost={r.steps_lost} refused={len(r.refused)}", flush=True)
    batches = None
    while step < total:
        if batches is None:
            sampler.set_epoch(sampler.epoch)  # keeps a restored mid-epoch position
            batches = iter(loader)
        try:
            x, y = next(batches)
        except StopIteration:
            sampler.set_epoch(sampler.epoch + 1)
            batches = None
            continue
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        step += 1
        ckpt.save(step, state)
        if step == kill_at and attempt == 0:
            ckpt.wait()
            dist.barrier()
            if rank == 1:
                if fault != "none":
                    ckpt.transport.call("test_fault", kind=fault, job=ckpt.job)
                print(f"KILLING rank={rank} step={step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    final = flatten({"model": model, "optim": opt})
    safetensors.torch.save_file({n: t.contiguous() for n, t in zip(final.names, final.tensors)},
                                os.path.join(out_dir, f"final-rank{rank}.safetensors"))
    print(f"DONE rank={rank} step={step}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
