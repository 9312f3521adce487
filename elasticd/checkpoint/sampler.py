"""A distributed sampler whose position is part of the checkpoint, and survives a new world size.

torch's ``DistributedSampler`` fixes each rank's share of an epoch when the epoch starts, so a
job that restarts mid-epoch — worse, with another number of ranks — either repeats or skips
samples. :class:`ElasticSampler` keeps, instead, the epoch and how many samples the whole job
has consumed in it. Every epoch has one permutation (seeded by ``seed + epoch``, independent of
the world size); at ``__iter__`` the sampler reads the current rank and world size and serves
the rest of that permutation strided by rank. After a restart at any world size, the remaining
samples are exactly the ones not yet seen: every sample of the epoch is seen exactly once.

The count advances on its own as indices are drawn (exact with ``num_workers=0``, where the
DataLoader draws one batch at a time), or explicitly with :meth:`advance` — required when
DataLoader workers prefetch ahead of training, since drawn is then not yet trained on. The
first call to ``advance`` switches automatic counting off. Put the sampler in the checkpointed
state; create it after ``init_process_group``. Worker side.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Indices of one rank's share of the rest of the current epoch.

    Args:
        dataset_len: number of samples.
        shuffle: a fresh permutation per epoch (else 0..n-1 in order).
        seed: the permutation's seed (``seed + epoch``); the same on every rank.
        drop_last: drop the epoch's tail that does not fill one sample per rank, so that every
            rank draws the same count (those samples are not seen that epoch). Otherwise the
            last round is short: some ranks draw one sample fewer, and none is seen twice.
        rank, world_size: override torch.distributed's (e.g. in tests, or without a group).
    """

    def __init__(self, dataset_len: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, *, rank: int | None = None,
                 world_size: int | None = None) -> None:
        if type(dataset_len) is not int or dataset_len < 0:
            raise ValueError(f"dataset_len must be an integer >= 0, got {dataset_len!r}")
        self.dataset_len, self.shuffle, self.seed, self.drop_last = (
            dataset_len, shuffle, seed, drop_last)
        self._rank, self._world = rank, world_size
        self.epoch = 0
        self.consumed = 0  # samples drawn by all ranks together in this epoch
        self._manual = False
        self._iter_start = 0

    # -- position -------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Moves to ``epoch``; its position restarts at 0 unless it is already the current
        one (so that calling it again after a restore keeps the restored position)."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def advance(self, samples: int) -> None:
        """Records that the job consumed ``samples`` more samples (all ranks together);
        turns automatic counting off."""
        if not self._manual:
            # What automatic counting added for the current iterator was drawn, not trained.
            self._manual, self.consumed = True, self._iter_start
        self.consumed = min(self.dataset_len, self.consumed + int(samples))

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                "dataset_len": self.dataset_len, "shuffle": self.shuffle,
                "manual": self._manual}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the position.

        Raises:
            ValueError: the state is for another dataset length, seed or shuffle setting
                (the permutation would differ, and "exactly once" would not hold).
        """
        for key in ("dataset_len", "seed", "shuffle"):
            if state.get(key, getattr(self, key)) != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r}, this sampler "
                                 f"{getattr(self, key)!r}")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self._manual = bool(state.get("manual", False))

    # -- iteration ------------------------------------------------------------------------

    def _where(self) -> tuple[int, int]:
        rank, world = self._rank, self._world
        dist = torch.distributed
        grouped = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if grouped else 0
        if world is None:
            world = dist.get_world_size() if grouped else 1
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world size {world}")
        return rank, world

    def _remaining(self, world: int) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            order = list(range(self.dataset_len))
        rest = order[self.consumed :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % world]
        return rest

    def __iter__(self) -> Iterator[int]:
        rank, world = self._where()
        rest = self._remaining(world)
        mine = rest[rank::world]
        start = self._iter_start = self.consumed
        for i, index in enumerate(mine):
            if not self._manual:
                # Round i is complete on every rank once each drew its i-th index (the short
                # last round counts only the ranks that have one).
                self.consumed = start + min(len(rest), (i + 1) * world)
            yield index
        if not self._manual:
            self.consumed = start + len(rest) if not self.drop_last else self.dataset_len

    def __len__(self) -> int:
        rank, world = self._where()
        return len(self._remaining(world)[rank::world])
