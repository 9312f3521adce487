"""A torchrun worker that checkpoints every step and raises the same exception at one step,
every time it runs (a bug in the script or its data): the crash loop elasticd must recognise.

Usage: ``crash_at_step.py STEP``. Restored after a restart, it reaches STEP again and raises
again; it prints ``step N rank R restart C`` per step.
"""

import os
import sys

import torch
import torch.distributed as dist

import elasticd


def main() -> None:
    crash_at = int(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt, "rng": elasticd.RNGState()}
    ckpt = elasticd.Checkpointer(every=1)
    step = ckpt.restore(state)
    while True:
        if step + 1 == crash_at:
            raise RuntimeError(f"boom at step {crash_at}")
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        step += 1
        ckpt.save(step, state)
        print(f"step {step} rank {rank} restart {restart}", flush=True)


if __name__ == "__main__":
    main()
