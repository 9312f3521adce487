"""The pytorch/examples multinode Trainer, ported to elasticd as a newcomer would
(tests/integration/workers/tutorial_trainer.py), as a daemon-run job: kill -9 of a worker
mid-epoch, the agent restarts the group and every rank restores from its daemon's RAM.

The Trainer probes its loader (``len(next(iter(loader))[0])``) before ``set_epoch`` every
epoch; the kill lands at the end of an epoch (the restored epoch has nothing left: the probe
must still get a batch and the loop none) or mid-epoch. Counting only the steps that were kept (for each step, the last attempt that ran it),
every rank trains exactly DistributedSampler's indices of every epoch, in order — each sample
once, plus DistributedSampler's one padded repeat (91 samples on 2 ranks) — and the job ends
after the one restart the kill caused (no crash loop at an epoch boundary). The same with
``DataLoader(num_workers=2)``, whose workers prefetch ahead of training.
"""

from __future__ import annotations

import collections
import os

import pytest
from torch.utils.data import DistributedSampler

from tests.chaos.faults import FaultPlan
from tests.chaos.harness import REPO, ChaosCluster, Shape

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(240)]

TRAINER = os.path.join(REPO, "tests", "integration", "workers", "tutorial_trainer.py")
N, WORLD, BATCH, EPOCHS = 91, 2, 4, 3
BATCHES = -(-(-(-N // WORLD)) // BATCH)  # DistributedSampler's 46 per rank: 12 batches


def expected(epoch: int, rank: int) -> list[int]:
    d = DistributedSampler(range(N), num_replicas=WORLD, rank=rank)  # seed 0, shuffled
    d.set_epoch(epoch)
    return list(d)


@pytest.mark.parametrize("workers,kill_at", [
    (0, BATCHES),  # at the end of epoch 0: the restore lands at or just after the boundary
    (2, BATCHES + 5),  # mid epoch 1, loader workers prefetching
])
def test_tutorial_trainer_trains_every_sample_once_across_a_worker_kill(tmp_path, workers,
                                                                        kill_at):
    shape = Shape(nodes=("n1", "n2"), standby=(), nnodes="2:2", steps=EPOCHS * BATCHES,
                  step_time=0.15, zero=False, etcd_members=1)
    cc = ChaosCluster(tmp_path, shape, train=TRAINER,
                      train_args=("--epochs", str(EPOCHS), "--batch-size", str(BATCH),
                                  "--dataset-size", str(N), "--workers", str(workers)))
    out = cc.run(FaultPlan().kill_worker("n2", at_step=kill_at), timeout=120)

    assert len(out.attempts) == 2, f"one kill, one restart expected:\n{out.summary()}"
    out.assert_sources({"local"})
    out.assert_steps_lost()
    out.assert_nothing_left()
    assert out.recoveries[0].step >= kill_at, out.summary()

    kept = out.kept_records()
    assert sorted({r["step"] for r in kept}) == list(range(1, EPOCHS * BATCHES + 1))
    trained: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    for r in sorted(kept, key=lambda r: r["step"]):
        assert r["world"] == WORLD
        trained[(r["epoch"], r["rank"])] += r["indices"]
    for epoch in range(EPOCHS):
        for rank in range(WORLD):
            assert trained[(epoch, rank)] == expected(epoch, rank), (
                f"epoch {epoch} rank {rank}: trained {trained[(epoch, rank)]}, "
                f"DistributedSampler's {expected(epoch, rank)}\n{out.summary()}")
        seen = collections.Counter(trained[(epoch, 0)] + trained[(epoch, 1)])
        assert set(seen) == set(range(N))
        assert sorted(seen.values()) == [1] * (N - 1) + [2]  # the one padded repeat
