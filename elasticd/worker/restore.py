"""Restore: every rank agrees on one (generation, step) that all of them can load, then loads it.

Each rank lists what it can reach — the snapshots its daemon holds in RAM for it, the complete
steps of the persistent tier, and the step the daemons committed (every rank's shard held by
``m`` daemons, so reachable from a peer's RAM after a node died) — and the ranks exchange those
lists (a fixed-size int64 ``all_gather``: no pickle, unlike ``all_gather_object``). The
candidates are the versions every rank holds plus the committed version; they are tried newest
first, so a newer step every rank still has locally wins over an older committed one. Each rank
fetches its shard (its own RAM first; then, for a committed version, ``ckpt_fetch``, which
copies it from a peer's RAM into this node's store; a snapshot that fails verification is
refused and another copy, or the persistent one of the same step, used instead), and an
``all_reduce(MIN)`` of "I have it" decides; only when every rank has its bytes in hand does any
rank load them into its state, so a failure never leaves a mix of steps. With nothing common,
training starts fresh, unless some rank's daemon did not answer (:class:`DaemonUnreachable`).

After a shrink (a node died and the job continues with fewer ranks) or a grow (a node joined),
the committed version of the other world is still a candidate when the state is replicated
across ranks (data parallel: every rank's model and optimizer are identical): new rank ``r``
loads old rank ``r``'s shard, and a rank beyond the old world loads old rank ``r % old``'s
(so after a grow the new ranks start with a copy of an old rank's RNG states too); the
sampler's position is global, so it carries over. State sharded across ranks is resharded
(:meth:`~elasticd.worker.sources.Sources.fetch_shards` fetches the other old ranks'
snapshots it needs): DTensors (FSDP2) by their saved boxes (:mod:`elasticd.worker.shards`), a
``ZeroRedundancyOptimizer`` by the partition map saved with each rank's shard (every old rank's
snapshot; ZeRO's own ``load_state_dict`` then keeps this rank's parameters' state).

A survivor of an in-process re-formation (``@elasticd.in_process``) whose rank or world size
moved also offers the snapshots of the rank it was, from its node's RAM, and so does a worker
its agent restarted on the same node (a fallback: told the rank it replaces): a step every rank
offers is tried first when newest, each rank loading the shard it wrote (see :func:`agree`);
a step some survivors completed one past the others is tried before it, handed by a holder
to each rank that lacks it over the new group (:mod:`elasticd.worker.handover`).
When every rank's live state still is the step picked first (a survivor whose state nothing
changed since it snapshotted that step, its own slot holding it: :mod:`elasticd.worker.held_state`),
nothing is fetched or loaded.

Whatever is restored, new snapshots start a new generation above every generation seen, so
snapshots of an abandoned timeline (written after the restored step, before the failure) never
outrank or mix with the new ones. Worker side: imports torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

import torch
import xxhash

from elasticd.errors import CheckpointError
from elasticd.worker import handover as _handover
from elasticd.worker.handover import Handover
from elasticd.worker.sources import Sources, Version
from elasticd.worker.state import StateError, load_into

log = logging.getLogger("elasticd.checkpoint")

_NONE = (-1, -1)


class RestoreError(CheckpointError, RuntimeError):
    """The agreed snapshot could not be loaded into the state on some rank (e.g. the model
    changed shape since it was saved); raised on every rank together."""


class DaemonUnreachable(RestoreError):
    """Some rank's daemon did not answer (frozen, or dead without its workers): the ranks
    cannot know what it holds, and must not start over from an older step or from scratch
    while a newer one is committed. Raised on every rank, so the whole group fails this
    attempt; the agent restarts it, by when that node has been fenced or its daemon is back."""


class ReplicaMismatch(RestoreError):
    """State that must be identical on every rank (a data-parallel model) differs after the
    restore: continuing would train diverged replicas in silence. Raised on every rank."""


def replicated_keys(state: Any, extra: Any = ()) -> list[str]:
    """Entries of ``state`` that every rank holds identically: DDP-wrapped modules (DDP keeps
    its replicas equal, so equality after a restore is a real invariant) plus ``extra``."""
    keys = [k for k, v in state.items() if isinstance(v, torch.nn.parallel.DistributedDataParallel)]
    return keys + [k for k in extra if k in state and k not in keys]


def state_digest(value: Any) -> int:
    """xxh3-64 over the names, dtypes, shapes and bytes of ``value``'s state-dict tensors."""
    h = xxhash.xxh3_64()
    sd = value.state_dict() if hasattr(value, "state_dict") else value
    for name, t in sd.items():
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).reshape(-1).numpy().data if t.numel() else b"")
    return h.intdigest()


def check_replicas_agree(state: Any, keys: list[str], collective: "Collective") -> None:
    """Compares the digests of ``keys`` across ranks (one all_gather of int64 pairs).

    Raises:
        ReplicaMismatch: on every rank, naming the entries that differ.
    """
    if not keys:
        return
    gathered = collective.all_gather(_digest_rows(state, keys))
    differ = [key for i, key in enumerate(keys) if len({g[i] for g in gathered}) > 1]
    if differ:
        raise ReplicaMismatch(_MISMATCH.format(", ".join(differ)))


_MISMATCH = ("after the restore, {} differ across ranks although they must be identical "
             "(data-parallel replicas): refusing to train diverged copies. Check that every "
             "rank builds the same model and that no rank restored another job's snapshot")
#: At most this many replicated entries are compared in the load's own collective (beside
#: its flag row; a TorchCollective row block holds 64); more take one of their own.
_DIGESTS_WITH_FLAG = 31


def _digest_rows(state: Any, keys: list[str]) -> list[Version]:
    """``keys``' digests (:func:`state_digest`) as int64-sized pairs."""
    return [(d >> 32, d & 0xFFFFFFFF) for d in (state_digest(state[key]) for key in keys)]


def _loaded_everywhere(state: Any, keys: list[str], collective: "Collective",
                       error: str) -> list[str] | None:
    """After the load: None when some rank could not load; else the ``keys`` (replicated
    entries) whose digests differ across ranks. One all_gather of a flag row and the digests
    (:meth:`Collective.gather_if_all_true`); with more digests than fit beside the flag row,
    an all_reduce and :func:`check_replicas_agree`'s all_gather."""
    if len(keys) > _DIGESTS_WITH_FLAG:
        if not collective.all_true(not error):
            return None
        check_replicas_agree(state, keys, collective)
        return []
    gathered = collective.gather_if_all_true(not error, [] if error else _digest_rows(state, keys))
    if gathered is None:
        return None
    return [key for i, key in enumerate(keys) if len({g[i] for g in gathered}) > 1]


@dataclasses.dataclass
class RestoreResult:
    """What :meth:`Checkpointer.restore` did.

    Attributes:
        step: the step restored (0 for a fresh start).
        next_generation: the generation new snapshots carry.
        source: "local" (this node's RAM), "peer" (bytes copied from another node's RAM, or a
            replica of another node's shard held here), "persistent", or "none".
        seconds, nbytes: time and bytes this rank spent restoring.
        steps_lost: newest step any rank had reached (as far as known) minus ``step``.
        refused: snapshots refused (or lost) on the way, with the reason.
        saved_world_size: the world size the restored snapshot was taken at (differs from the
            current one after a shrink); 0 for a fresh start.
        direct: the figures of a reshard whose rows this rank fetched itself
            (:mod:`.direct`), else None.
        in_memory: every rank's live state already was the step (source "local": its own
            slot holds it), so nothing was loaded (:mod:`.held_state`).
        times: the restore's moments, wall time (``wall`` of :func:`restore`): ``discovered``
            (this rank's sources listed), ``agreed`` (the ranks' all_gather returned),
            ``fetched`` (this rank's shard in hand), ``loaded`` (every rank loaded): the
            in-process benchmark's phases inside the restore.
    """

    step: int = 0
    generation: int = 0
    next_generation: int = 0
    source: str = "none"
    seconds: float = 0.0
    nbytes: int = 0
    steps_lost: int = 0
    refused: list[str] = dataclasses.field(default_factory=list)
    saved_world_size: int = 0
    times: dict[str, float] = dataclasses.field(default_factory=dict)
    in_memory: bool = False
    direct: dict[str, Any] | None = None


class Collective:
    """The collectives restore needs, across the group's ranks (tests simulate ranks without
    torch.distributed). A subclass gives :meth:`all_gather`; the others are one all_gather
    each by default, so every collective has them all (:class:`TorchCollective` ANDs flags
    in an all_reduce instead)."""

    def all_gather(self, rows: list[Version]) -> list[list[Version]]:
        """Every rank's ``rows``, in rank order."""
        raise NotImplementedError

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        return self.all_true_each([flag])[0]

    def all_true_each(self, flags: Any) -> list[bool]:
        """Each of ``flags`` ANDed across ranks, in one collective."""
        flags = [bool(f) for f in flags]
        gathered = self.all_gather([(int(f), 0) for f in flags])
        return [all(g[i][0] == 1 for g in gathered) for i in range(len(flags))]

    def send(self, tensor: torch.Tensor, to: int) -> None:
        """Sends a CPU ``tensor`` to rank ``to`` (point to point: a handover, :mod:`.handover`)."""
        raise NotImplementedError

    def recv(self, tensor: torch.Tensor, frm: int) -> None:
        """Receives into the CPU ``tensor`` what rank ``frm`` sends."""
        raise NotImplementedError

    def gather_if_all_true(self, flag: bool, rows: list[Version]) -> list[list[Version]] | None:
        """Every rank's ``rows`` when ``flag`` holds on every rank, else None: one all_gather
        (a flag row ahead of the rows) where all_true and all_gather were two."""
        gathered = self.all_gather([(1 if flag else 0, len(rows)), *rows])
        if any(g[0][0] != 1 for g in gathered):
            return None
        return [g[1:1 + g[0][1]] for g in gathered]


class Solo(Collective):
    """One process, no process group."""

    def all_gather(self, rows: list[Version]) -> list[list[Version]]:
        return [list(rows)]


class TorchCollective(Collective):
    """Over the default (already initialised) process group, with int64 tensors only: a block
    of ``max_rows`` rows per rank."""

    def __init__(self) -> None:
        self.dist, self.max_rows = torch.distributed, 64
        backend = self.dist.get_backend()
        self.device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                       else torch.device("cpu"))

    def all_gather(self, rows: list[Version]) -> list[list[Version]]:
        mine = torch.full((self.max_rows, 2), -1, dtype=torch.int64)
        for i, row in enumerate(rows[: self.max_rows]):
            mine[i, 0], mine[i, 1] = row
        mine = mine.to(self.device)
        out = [torch.empty_like(mine) for _ in range(self.dist.get_world_size())]
        self.dist.all_gather(out, mine)
        return [[(int(g), int(s)) for g, s in o.cpu().tolist()] for o in out]

    def send(self, tensor: torch.Tensor, to: int) -> None:
        self.dist.send(tensor.to(self.device), to)

    def recv(self, tensor: torch.Tensor, frm: int) -> None:
        into = tensor if self.device.type == "cpu" else torch.empty_like(tensor, device=self.device)
        self.dist.recv(into, frm)
        if into is not tensor:
            tensor.copy_(into.cpu())

    def all_true_each(self, flags: Any) -> list[bool]:
        """Each of ``flags`` ANDed across ranks, in one all_reduce."""
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return [bool(v) for v in t.cpu().tolist()]


# Rows every rank sends ahead of its versions: its progress, the committed version it was told
# of, (world size of that committed version, 1: the slot that said whether its state could be
# restored at another world size, which every state elasticd snapshots now can), and (1 if its
# daemon did not answer, K). K: how many of the rows after the head are its own offers
# (Sources.own, newest first), the versions follow them; 0 from a rank with no previous rank
# (a fresh process) and from an elasticd older than own offers, whose rows are then read as
# they always were. Then the version its live state still is (Sources.held_offer), or _NONE.
_HEAD = 5
#: At most this many own offers per rank (a rank's slots hold two or three steps).
_OWN_ROWS = 8


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What the ranks agreed to try.

    Attributes:
        candidates: (version, world size it was saved at), newest first.
        seen: the newest version any rank knows of, or None.
        handover: the step some survivors completed and others not, which the holders hand
            to the others (:mod:`.handover`), or None.
        held: the version every rank's live state still is (:mod:`.held_state`), each rank's
            own slot holding it, or None.
    """

    candidates: list[tuple[Version, int]]
    seen: Version | None
    handover: Handover | None = None
    held: Version | None = None


def agree(sources: Sources, collective: Collective,
          mark: Callable[[str], None] = lambda name: None) -> Agreement:
    """The versions to try on every rank (identical on all of them) and the newest seen.

    Besides the versions every rank holds at the current world size and the committed one,
    a step every rank offers from its own slot (:attr:`Sources.own`: survivors of an
    in-process re-formation, each the snapshot of the rank it was) is a candidate, at the
    previous world size: each rank then loads the shard it wrote itself (or, restarted on
    its node, the rank it replaces wrote: :func:`elasticd.worker.in_process.restarted_from`).
    Only when *every* rank offers it: a new node's rank has no own slot, and a step not
    committed may be held nowhere for its new rank. The dead ranks' shards of that step are
    not needed: a state that is not sharded is the same on every rank (data parallel; after a
    restart too each new rank loads one old rank's snapshot, and the replicas are checked
    equal after the load), and a sharded one is refused at the fetch
    (:meth:`Sources.fetch`), so the ranks take the next candidate, the committed step.

    Newer still, the step some survivors completed and the others not (their collective of
    it failed): the survivors that hold it hand it to the others (:func:`.handover.plan`);
    fully available for replicated state, since any one survivor's snapshot of it is a whole
    restore, and refused by the holders for sharded state, which then takes the step all hold.
    """
    mine = sources.discover()
    mark("discovered")
    own = sorted(sources.own, reverse=True)[:_OWN_ROWS]
    head = [sources.progress or _NONE, sources.committed or _NONE,
            (sources.committed_world or -1, 1),
            (1 if sources.unreachable else 0, len(own)), sources.held_offer() or _NONE]
    gathered = [_split(rows) for rows in collective.all_gather(head + own + mine)]
    mark("agreed")
    offers = [rows.pop() for rows in gathered]  # gathered: head + versions, as before
    silent = [rank for rank, rows in enumerate(gathered) if rows[3][0] == 1]
    if silent:
        raise DaemonUnreachable(
            f"the elasticd daemon of rank(s) {', '.join(map(str, silent))} does not answer"
            f"{sources.why_unreachable()}: restoring "
            "without it could start over from an older step than the committed one, so this "
            "attempt fails on every rank and the agent starts another once that node is fenced "
            "or its daemon answers again")
    seen = [v for rows, own_rows in zip(gathered, offers)
            for v in rows[:2] + rows[_HEAD:] + own_rows if v != _NONE]
    common = set.intersection(*({v for v in rows[_HEAD:] if v != _NONE} for rows in gathered))
    candidates = {v: sources.saved_world(v) for v in common}
    handover = None
    if sources.previous is not None and all(offers):
        # Every rank a survivor (else some offer is empty): the steps all of them hold.
        sources.own_agreed = set.intersection(*(set(o) for o in offers)) - {_NONE}
        candidates.update((v, sources.previous[1]) for v in sources.own_agreed)
        # A step some of them completed one past the others: the holders hand it over.
        handover = _handover.plan(offers, sources.own_agreed)
        if handover is not None:
            candidates[handover.version] = sources.previous[1]
            if handover.holder_of(sources.rank) is None:
                sources.own_agreed.add(handover.version)
                sources.sending = handover.version if handover.sender_to(sources.rank) else None
    replicated = all(rows[2][1] == 1 for rows in gathered)
    committed = {(rows[1], rows[2][0]) for rows in gathered if rows[1] != _NONE}
    sources.fetchable = {v for v, _ in committed}
    for version, world in sorted(committed, reverse=True):
        if version in candidates:
            continue
        if world == sources.world or replicated:
            candidates[version] = world
        else:
            log.warning("elasticd: committed step %s was saved by %d ranks and %d run now, but "
                        "a rank's elasticd (older) cannot restore it at the new world size; "
                        "falling back", version, world, sources.world)
    held = {rows[4] if len(rows) > 4 else _NONE for rows in gathered}
    return Agreement(sorted(candidates.items(), reverse=True), max(seen, default=None), handover,
                     held.pop() if len(held) == 1 and _NONE not in held else None)


def _split(rows: list[Version]) -> list[Any]:
    """One rank's gathered rows as head + versions, with its own offers appended as a last
    item (a list; empty without any)."""
    count = rows[3][1] if len(rows) > 3 else 0
    count = count if 0 <= count <= len(rows) - _HEAD else 0
    return [*rows[:_HEAD], *rows[_HEAD + count:], list(rows[_HEAD:_HEAD + count])]


def restore(state: Any, sources: Sources, collective: Collective, clock: Any,
            replicated: list[str] = (), wall: Any = None) -> RestoreResult:
    """Runs the whole protocol on this rank; see the module docstring.

    Args:
        replicated: entries that must be identical on every rank; compared by checksum
            after a restore (:func:`check_replicas_agree`).
        wall: the wall clock :attr:`RestoreResult.times` reads (None: no moments).

    Raises:
        RestoreError: on every rank, when the agreed snapshot does not fit some rank's state.
        ReplicaMismatch: on every rank, when ``replicated`` entries differ after it.
    """
    start = clock()
    result = RestoreResult()

    def mark(name: str) -> None:
        if wall is not None:
            result.times[name] = wall()

    differ: list[str] | None = []
    sources.preload(state)
    agreed = agree(sources, collective, mark)
    seen = agreed.seen
    candidates = agreed.candidates
    if candidates and candidates[0][0] == agreed.held:
        # Every rank's memory already is the step the agreement picks first, and each rank's
        # own slot holds it (its daemon listed it): nothing to fetch, load or compare (the
        # replicas were equal at the step's start and took the same update). The same choice
        # on every rank: it is made from the gathered rows.
        candidates = []
        mark("fetched")
        mark("loaded")
        result.step, result.generation = agreed.held[1], agreed.held[0]
        result.source, result.in_memory = "local", True
        result.saved_world_size = sources.previous[1] if sources.previous else sources.world
        if result.saved_world_size != sources.world:
            log.warning("elasticd: rank %d restored step %s saved by %d ranks into a world of "
                        "%d (old rank %d's snapshot, in its own slot: already in memory, "
                        "nothing loaded)", sources.rank, agreed.held, result.saved_world_size,
                        sources.world, sources.previous[0] if sources.previous else sources.rank)
    for version, world in candidates:
        if world != sources.world:
            sources.prepare(state)
        got = sources.fetch(version, result.refused, world,
                            state=state if world != sources.world else None)
        if agreed.handover is not None and version == agreed.handover.version:
            got = sources.handed(got, agreed.handover, collective, result.refused, world)
        if got is not None:
            got = sources.fetch_shards(got, version, result.refused, world, state)
        mark("fetched")
        try:
            # One collective for both flags (each was an all_reduce of its own).
            reachable, have = collective.all_true_each([not sources.unreachable,
                                                        got is not None])
            if not reachable:
                # A daemon that does not answer a fetch may still hold the step: trying older
                # ones would end, in the worst case, in a fresh start while it is committed.
                raise DaemonUnreachable(
                    f"a rank's elasticd daemon did not answer while fetching step {version}"
                    f"{sources.why_unreachable()}: this "
                    "attempt fails on every rank and the agent starts another")
            if not have:
                log.warning("elasticd: step %s is not loadable on every rank; trying an older "
                            "one", version)
                continue
            assert got is not None
            error = got.error
            try:
                if not error:
                    load_into(state, got.tensors, got.meta, names=got.names,
                              others=[(o.names, o.tensors, o.meta) for o in got.others],
                              base_views=got.release is not None, files=got.slot_files())
            except StateError as exc:
                error = str(exc)
            # Whether every rank loaded, and the replicas' digests, in one all_gather.
            differ = _loaded_everywhere(state, list(replicated), collective, error)
            if differ is None:
                raise RestoreError(f"snapshot {version} could not be loaded on every rank"
                                   f"{': ' + error if error else ''}")
            mark("loaded")
            result.step, result.generation = version[1], version[0]
            result.source, result.nbytes = got.source, got.nbytes
            result.direct = got.figures
            result.saved_world_size = world
            if world != sources.world:
                log.warning("elasticd: rank %d restored step %s saved by %d ranks into a world "
                            "of %d (old rank %d's snapshot%s)", sources.rank, version, world,
                            sources.world, sources.rank % world if got.rank is None
                            else got.rank,
                            f" and {len(got.others)} more: resharded" if got.others
                            else ": the state is replicated")
            break
        finally:
            if got is not None:
                got.close()  # the pieces read in place: their slots go back
    if result.source == "none" and candidates and not collective.all_true(not sources.tainted):
        # A direct fetch that failed landed some rows of a step in the live tensors before
        # (worker/direct.py): this state is neither that step nor the script's own start.
        raise RestoreError("no step could be loaded, and a failed fetch had written part of "
                           "one into the live state: this attempt fails on every rank and "
                           "the agent starts fresh processes")
    if result.source != "none" and differ:
        raise ReplicaMismatch(_MISMATCH.format(", ".join(differ)))
    result.next_generation = seen[0] + 1 if seen is not None else 0
    result.steps_lost = max(0, seen[1] - result.step) if seen is not None else 0
    result.seconds = clock() - start
    log.info("elasticd: rank %d (pid %d) restored step %d (generation %d) from %s in %.3f s, "
             "%d bytes, %d steps lost; new snapshots use generation %d", sources.rank,
             os.getpid(), result.step, result.generation,
             "memory (its own slot holds it)" if result.in_memory else result.source,
             result.seconds,
             result.nbytes, result.steps_lost, result.next_generation)
    return result
