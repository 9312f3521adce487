"""The pytorch/examples multinode tutorial (distributed/ddp-tutorial-series/multinode.py),
ported to elasticd the way its README tells a newcomer to: ``DistributedSampler`` becomes
``elasticd.ElasticSampler``, the snapshot file becomes a ``Checkpointer``.

The Trainer is the tutorial's, probe included: ``_run_epoch`` reads the batch size with
``len(next(iter(self.train_data))[0])`` and ``len(self.train_data)`` before
``sampler.set_epoch(epoch)``. CPU and gloo instead of CUDA and NCCL.

Only the lines marked "test:" are not what a newcomer writes: they print the lines
tests/chaos/harness.py parses and record each step's sample ids (the dataset's items carry
their index), so the test can check every sample of every epoch was trained exactly once.

Usage: ``torchrun ... tutorial_trainer.py [--epochs E] [--batch-size B] [--dataset-size N]
[--workers W] --steps S --step-time T --sample-log DIR --out DIR`` (S: the steps of E epochs).
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import elasticd


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g))
                     for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return (*self.data[index], index)  # test: the sample's id rides along


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, args):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.args = args
        # In place of the tutorial's snapshot file: the whole training state, every step.
        self.state = {"model": self.model, "optim": self.optimizer,
                      "sampler": self.train_data.sampler, "rng": elasticd.RNGState(),
                      "epoch": 0}
        self.ckpt = elasticd.Checkpointer(every=1)
        self.step = self.ckpt.restore(self.state)
        self.epochs_run = self.state["epoch"]
        self.model = DDP(self.model)
        self._test_started()

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}", flush=True)
        self.train_data.sampler.set_epoch(epoch)
        self.state["epoch"] = epoch
        for source, targets, ids in self.train_data:
            loss = self._run_batch(source, targets)
            self.step += 1
            self.ckpt.save(self.step, self.state)
            self._test_record(epoch, ids, loss)

    def train(self, max_epochs: int):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
        self.ckpt.close()

    # -- test: what tests/chaos/harness.py reads ---------------------------------------------

    def _test_started(self):
        r = self.ckpt.last_restore
        print(f"start rank {self.global_rank} world {self.world} restart "
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} pid {os.getpid()} restored "
              f"step {self.step} from {r.source if r else 'none'} in "
              f"{r.seconds if r else 0:.3f} s, steps lost {r.steps_lost if r else 0}", flush=True)
        os.makedirs(self.args.sample_log, exist_ok=True)
        attempt = torch.tensor([time.time_ns()], dtype=torch.int64)
        torch.distributed.broadcast(attempt, 0)  # one id for every rank of this worker group
        self.attempt = attempt.item()
        self.records = open(os.path.join(
            self.args.sample_log,
            f"samples-{self.attempt}-rank{self.global_rank}-{os.getpid()}.jsonl"), "a",
            buffering=1)

    def _test_record(self, epoch, ids, loss):
        self.records.write(json.dumps({
            "attempt": self.attempt, "rank": self.global_rank, "world": self.world,
            "step": self.step, "epoch": epoch, "indices": ids.tolist()}) + "\n")
        print(f"step {self.step} world {self.world} rank {self.global_rank} restart "
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} loss {loss.item():.5f}",
              flush=True)
        time.sleep(self.args.step_time)


def load_train_objs(size):
    train_set = MyTrainDataset(size)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int, workers: int):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=workers,
        sampler=elasticd.ElasticSampler(dataset)
    )


def main(args):
    torch.set_num_threads(1)
    ddp_setup()
    dataset, model, optimizer = load_train_objs(args.dataset_size)
    train_data = prepare_dataloader(dataset, args.batch_size, args.workers)
    trainer = Trainer(model, train_data, optimizer, args)
    trainer.train(args.epochs)
    print(f"done rank {trainer.global_rank} world {trainer.world} steps {trainer.step}",
          flush=True)  # test
    destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # docs/facts.md: avoids a rare SIGABRT after destroy_process_group


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("--epochs", default=3, type=int)
    parser.add_argument("--batch-size", default=4, type=int)
    parser.add_argument("--dataset-size", default=91, type=int)
    parser.add_argument("--workers", default=0, type=int, help="DataLoader num_workers")
    # test: what the chaos harness passes
    parser.add_argument("--steps", type=int)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--sample-log", required=True)
    parser.add_argument("--out", default="")
    main(parser.parse_args())
