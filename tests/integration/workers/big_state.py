"""A worker whose snapshot takes a good part of each step: 160 MiB of state (in the test), snapshotted every
step, so a stop that does not wait for the snapshot in flight would often tear one.

Usage: ``torchrun ... big_state.py MIB``. Prints ``step N saved S`` per step (S: whether the
snapshot of step N was started) and runs until stopped.
"""

import sys
import time

import torch

import elasticd


def main() -> None:
    mib = int(sys.argv[1])
    torch.set_num_threads(1)
    state = {"w": torch.zeros(mib * 2**20 // 4)}
    ckpt = elasticd.Checkpointer(every=1)
    step = ckpt.restore(state)
    while True:
        state["w"].add_(1.0)  # the step's "training": every byte changes
        step += 1
        saved = ckpt.save(step, state)
        print(f"step {step} saved {int(saved)}", flush=True)
        time.sleep(0.01)


if __name__ == "__main__":
    main()
