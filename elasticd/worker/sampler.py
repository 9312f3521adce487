"""A drop-in for torch's ``DistributedSampler`` whose position is part of the checkpoint, and
survives a new world size.

``DistributedSampler`` fixes each rank's share of an epoch when the epoch starts, so a job that
restarts mid-epoch — worse, with another number of ranks — repeats or skips samples.
:class:`ElasticSampler` serves the same indices (one permutation per epoch seeded by
``seed + epoch``, strided by rank, padded or trimmed as ``DistributedSampler`` does), and keeps
in its ``state_dict`` the epoch and how many samples of it the whole job has trained. After a
restore, at any world size, the loader serves exactly the rest of the epoch.

What counts as trained is what the training loop received: each iterator finds the
``DataLoader`` iterator that draws from it and counts the batches that loader returned to the
loop (not the indices its workers prefetched), so ``num_workers > 0`` is exact. Iterated by
hand, every index drawn counts.

Where it differs from ``DistributedSampler`` (iterating again within an epoch, an epoch
restored complete, ``len()``, ``pad=False``, batches in order), and why every sample once needs
the same dataset after a restart (a split drawn without a seed; the fingerprint a ``Subset``
is checked by): docs/worker-api.md, "ElasticSampler".

Put the sampler in the checkpointed state; create it after ``init_process_group``. Worker side.
"""

from __future__ import annotations

import array
import logging
import math
import sys
import weakref
from typing import Any, Iterator

import torch
import xxhash

log = logging.getLogger(__name__)

_FRAMES_UP = 8  # how far up to look for the DataLoader iterator that draws from a new iterator


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Indices of one rank's share of the rest of the current epoch.

    Args:
        dataset: the dataset, as ``DistributedSampler`` takes it (anything with ``len()``; a
            split such as ``random_split``'s is checked at restore: docs/worker-api.md), or its
            length when the dataset is not at hand.
        num_replicas: world size; defaults to torch.distributed's (1 without a group).
        rank: this rank; defaults to torch.distributed's (0 without a group).
        shuffle: a fresh permutation per epoch (else 0..n-1 in order).
        seed: the permutation's seed (``seed + epoch``); the same on every rank.
        drop_last: drop the epoch's tail that does not fill one sample per rank, so that every
            rank draws the same count (those samples are not seen that epoch).
        world_size: another name for ``num_replicas``.
        pad: with ``drop_last`` False, repeat the epoch's first samples so that every rank
            draws the same count, as ``DistributedSampler`` does (at most ``world - 1`` repeats
            an epoch). False: no repeat, and the last round is short.
    """

    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 world_size: int | None = None, pad: bool = True) -> None:
        n = dataset if type(dataset) is int else _length(dataset)
        if n < 0:
            raise ValueError(f"dataset length must be >= 0, got {n!r}")
        if num_replicas is not None and world_size is not None and num_replicas != world_size:
            raise ValueError(f"num_replicas={num_replicas} and world_size={world_size} differ; "
                             "give one of them")
        self.dataset_len, self.shuffle, self.seed, self.drop_last, self.pad = (
            n, shuffle, seed, drop_last, pad)
        self.split = split_fingerprint(dataset)
        self._rank, self._world = rank, num_replicas if num_replicas is not None else world_size
        self.epoch = 0
        self._start = 0  # where this process's pass over the epoch starts (0, or restored)
        self._active: _Iterator | None = None  # the pass's iterator the loop drew from last
        self._pass = 0  # which pass the iterators belong to (older ones count no more)
        self._restored: int | None = None  # position load_state_dict set, until training goes on
        self._serve_rest = False  # set_epoch re-entered the restored epoch: serve its rest
        self._repeats_restored = False  # this pass repeats an epoch restored as complete
        self._warned: set[str] = set()

    # -- position -------------------------------------------------------------------------

    @property
    def consumed(self) -> int:
        """Samples of the epoch the whole job has trained (all ranks together)."""
        done = self._active.consumed() if self._active is not None else 0
        return min(self.dataset_len, self._start + done)

    @consumed.setter
    def consumed(self, value: int) -> None:
        self._new_pass(int(value))
        self._restored = None

    def set_epoch(self, epoch: int) -> None:
        """Moves to ``epoch`` and its start; on the epoch a restore left the sampler in, keeps
        the restored position instead (so that the training loop, calling it again after a
        restore, resumes mid-epoch), and drops what iterators drew before."""
        epoch = int(epoch)
        if epoch != self.epoch:
            if self._restored is not None and epoch < self.epoch:
                self._warn("back", f"ElasticSampler: set_epoch({epoch}) after restoring epoch "
                           f"{self.epoch}: epochs {epoch}..{self.epoch - 1} are trained again; "
                           "keep the epoch in the checkpointed state and resume from it")
            self.epoch, self._restored, self._serve_rest = epoch, None, False
            self._new_pass(0)
        elif self._restored is not None:
            self._new_pass(self._restored)
            self._serve_rest = True

    def state_dict(self) -> dict[str, Any]:
        position = self.consumed
        if self._restored is not None and position > self._start:
            # Training goes on from the restore: set_epoch no longer returns to it.
            if self._repeats_restored:
                self._warn("repeat", f"ElasticSampler: epoch {self.epoch} was complete in the "
                           "restored checkpoint and the loader was iterated again without "
                           f"set_epoch({self.epoch}) first: this pass trains epoch "
                           f"{self.epoch} again, as DistributedSampler would. Call "
                           "sampler.set_epoch(epoch) before each epoch's loop")
            self._restored = None
        return {"epoch": self.epoch, "consumed": position, "seed": self.seed,
                "dataset_len": self.dataset_len, "shuffle": self.shuffle, "split": self.split}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the position.

        Raises:
            ValueError: the state is for another dataset length, seed or shuffle setting
                (the permutation would differ, and "exactly once" would not hold).
        """
        for key in ("dataset_len", "seed", "shuffle"):
            if state.get(key, getattr(self, key)) != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r}, this sampler "
                                 f"{getattr(self, key)!r}: build the sampler as the job "
                                 "that saved it did")
        saved = state.get("split")
        if isinstance(saved, str) and saved and self.split and saved != self.split:
            self._warn("split", "ElasticSampler: this dataset split selects other samples than "
                       "the one the checkpoint was saved with, so the restored position no "
                       "longer means 'every sample once' (samples of the old training split "
                       "are now trained, or skipped). A split drawn at random must be seeded: "
                       "random_split(dataset, sizes, "
                       "generator=torch.Generator().manual_seed(0))")
        self.epoch = int(state["epoch"])
        self._new_pass(min(self.dataset_len, int(state["consumed"])))
        self._restored, self._serve_rest = self._start, False

    def _new_pass(self, start: int) -> None:
        self._start, self._active, self._repeats_restored = start, None, False
        self._pass += 1

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

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

    def _next_start(self) -> tuple[int, bool]:
        """Where the next iterator starts, and whether that begins a new pass."""
        if not self._serve_rest and self.consumed >= self.dataset_len:
            # The epoch is all trained: another pass over it, as DistributedSampler serves
            # when set_epoch is not called.
            return 0, True
        return self._start, False

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_len))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=g).tolist()

    def _share(self, start: int, rank: int, world: int) -> tuple[list[int], int]:
        """This rank's indices of the epoch from ``start``, and how many positions of the
        epoch they cover for the whole job (padding excluded)."""
        order = self._order()
        rest = order[start:]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % world]
        covered = len(rest)
        if self.pad and not self.drop_last and len(rest) % world:
            # DistributedSampler's padding: the epoch's first samples again.
            missing = world - len(rest) % world
            rest += (order * math.ceil(missing / len(order)))[:missing]
        return rest[rank::world], covered

    def __iter__(self) -> Iterator[int]:
        rank, world = self._where()
        start, fresh = self._next_start()
        if fresh:
            repeats = self._restored is not None
            self._new_pass(start)
            self._repeats_restored = repeats
        elif self._serve_rest:
            self._serve_rest, self._restored = False, None
        mine, covered = self._share(start, rank, world)
        return _Iterator(self, mine, covered, self.dataset_len - start, world)

    def __len__(self) -> int:
        rank, world = self._where()
        return len(self._share(self._next_start()[0], rank, world)[0])


class _Iterator:
    """One iterator over a rank's share, counting what the training loop received of it (what
    counts: the module docstring). Its first ``next`` finds the ``DataLoader`` iterator drawing
    from it on the call stack, which then reports to it (:func:`_watch`)."""

    def __init__(self, sampler: ElasticSampler, indices: list[int], covered: int, to_end: int,
                 world: int) -> None:
        self.sampler, self.indices, self.covered, self.to_end, self.world = (
            sampler, indices, covered, to_end, world)
        self.pass_id = sampler._pass
        self.drawn = 0
        self.returned = 0  # batches the loader returned to the loop from this iterator
        self.ended = False  # the loader told the loop it has no more
        self.bound = self.watched = self.unwatched_first = False
        self.batch, self.drop = 1, False

    def __iter__(self) -> "_Iterator":
        return self

    def __next__(self) -> int:
        if not self.bound:
            self._bind(sys._getframe(1))
            self.touch()  # the loop's new iterator (the loader's own reports follow)
        elif not self.watched:
            self.touch()
        if self.drawn >= len(self.indices):
            raise StopIteration
        self.drawn += 1
        return self.indices[self.drawn - 1]

    def touch(self) -> None:
        """The loop drew from this iterator last: the position is its."""
        if self.pass_id == self.sampler._pass:
            self.sampler._active = self

    def _bind(self, frame: Any) -> None:
        self.bound = True
        for _ in range(_FRAMES_UP):
            if frame is None:
                return
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.utils.data.dataloader._BaseDataLoaderIter):
                break
            frame = frame.f_back
        else:
            return
        if "_next_data" not in vars(owner):
            # Drawn from inside the loader's own (not yet watched) _next_data: without
            # workers the first batch is fetched that way, and it goes to the loop.
            while frame is not None and frame.f_locals.get("self") is owner:
                if frame.f_code.co_name == "_next_data":
                    self.unwatched_first = True
                    break
                frame = frame.f_back
        index_sampler = owner._index_sampler
        if index_sampler is self.sampler:
            pass  # batch_size=None: each item the loader returns is one index
        elif (isinstance(index_sampler, torch.utils.data.BatchSampler)
              and index_sampler.sampler is self.sampler):
            self.batch, self.drop = index_sampler.batch_size, index_sampler.drop_last
        else:
            if getattr(owner, "_num_workers", 0):
                self.sampler._warn("batch_sampler", "ElasticSampler: the DataLoader's "
                                   "batch_sampler is not its own; the position counts the "
                                   "indices drawn, which its workers prefetch ahead of training")
            return
        self.watched = _watch(owner, self)

    def consumed(self) -> int:
        """Positions of the epoch the whole job has trained from this pass's start."""
        total = len(self.indices)
        if self.watched:
            returned = self.returned + (self.unwatched_first and self.drawn > 0)
            trained = min(returned * self.batch, self.drawn)
            batches = total // self.batch if self.drop else math.ceil(total / self.batch)
            done = self.ended or (self.drawn >= total and returned >= batches)
        else:
            trained, done = self.drawn, self.drawn >= total
        if done:
            return self.to_end  # the dropped tail (drop_last) goes with the epoch's end
        return min(self.covered, trained * self.world)


def _watch(loader_iter: Any, it: _Iterator) -> bool:
    """Makes ``loader_iter`` report to ``it`` each batch it returns to the loop, and its end.

    The DataLoader iterator's ``_next_data`` (one call per batch ``__next__`` returns, in the
    main process, whatever the workers) is wrapped on the instance, once; with persistent
    workers the same iterator serves every epoch and reports to the newest ``_Iterator``.
    The wrapper holds the loader iterator weakly, so that an abandoned one is freed (and its
    workers shut down) at once. Returns False where torch has no such method.
    """
    loader_iter._elasticd_iterator = it
    if "_next_data" in vars(loader_iter):
        return True
    fn = getattr(type(loader_iter), "_next_data", None)
    if fn is None:
        return False
    ref = weakref.ref(loader_iter)

    def _next_data() -> Any:
        owner = ref()
        assert owner is not None  # it is the one calling
        target = owner._elasticd_iterator
        try:
            data = fn(owner)
        except StopIteration:
            target.ended = True
            target.touch()
            raise
        target.returned += 1
        target.touch()
        return data

    loader_iter._next_data = _next_data
    return True


def split_fingerprint(dataset: Any) -> str:
    """Which samples a split selects (a ``Subset``'s indices, nested ones in turn): a hash, or
    "" for anything else (a whole dataset, a length): nothing to check."""
    h, found = xxhash.xxh64(), False
    while isinstance(dataset, torch.utils.data.Subset):
        indices = dataset.indices
        if isinstance(indices, torch.Tensor):
            indices = indices.tolist()
        h.update(array.array("q", indices).tobytes())
        h.update(b"|")
        dataset, found = dataset.dataset, True
    return h.hexdigest() if found else ""


def _length(dataset: Any) -> int:
    try:
        return len(dataset)
    except TypeError as exc:
        raise TypeError(f"ElasticSampler needs a dataset with len() or its length, got "
                        f"{type(dataset).__name__}") from exc
