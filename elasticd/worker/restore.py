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
training starts fresh. A rank whose daemon does not answer cannot say what it holds, so then
the restore fails on every rank (:class:`DaemonUnreachable`) rather than start fresh.

After a shrink (a node died and the job continues with fewer ranks) or a grow (a node joined),
the committed version of the other world is still a candidate when the state is replicated
across ranks (data parallel: every rank's model and optimizer are identical): new rank ``r``
loads old rank ``r``'s shard, and a rank beyond the old world loads old rank ``r % old``'s
(so after a grow the new ranks start with a copy of an old rank's RNG states too); the
sampler's position is global, so it carries over. State sharded across ranks is resharded
(:meth:`Sources.fetch_shards` fetches the other old ranks' snapshots it needs): DTensors
(FSDP2) by their saved boxes (:mod:`elasticd.worker.shards`), a
``ZeroRedundancyOptimizer`` by the partition map saved with each rank's shard (every old rank's
snapshot; ZeRO's own ``load_state_dict`` then keeps this rank's parameters' state).

Whatever is restored, new snapshots start a new generation above every generation seen, so
snapshots of an abandoned timeline (written after the restored step, before the failure) never
outrank or mix with the new ones. Worker side: imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import mmap
import os
from typing import Any, Callable, Iterator, Protocol

import torch

from elasticd.worker.copier import read_tensors, tensor_views
from elasticd.snapshot.format import SnapshotError, dtensor_nodes
from elasticd.snapshot.reader import SnapshotReader
from elasticd.snapshot.segment import map_fd
from elasticd.errors import CheckpointError
from elasticd.persistence.tier import Tier, TierError
from elasticd.worker.client import DaemonUnavailable

log = logging.getLogger("elasticd.checkpoint")

Version = tuple[int, int]
_NONE = (-1, -1)
#: Seconds a rank waits for the daemon's answer to ``ckpt_fetch``. The daemon bounds the
#: fetch itself, each request to a holder by a deadline from its bytes and the measured link
#: rate (elasticd.replication.deadline), and answers "lost" when no holder can serve; the
#: client's default 10 s would give up on a shard that simply takes longer to move (1 GiB at
#: the 50 MB/s assumed before a measurement) and fail the attempt on every rank, again at
#: every attempt. A daemon that stops answering altogether is the agent's to notice
#: (elasticd.agent.daemon_watch fences the node).
FETCH_WAIT = 1800.0


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
    from torch.nn.parallel import DistributedDataParallel

    keys = [k for k, v in state.items() if isinstance(v, DistributedDataParallel)]
    return keys + [k for k in extra if k in state and k not in keys]


def state_digest(value: Any) -> int:
    """xxh3-64 over the names, dtypes, shapes and bytes of ``value``'s state-dict tensors."""
    import xxhash

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
    rows = []
    for key in keys:
        d = state_digest(state[key])
        rows.append((d >> 32, d & 0xFFFFFFFF))
    gathered = collective.all_gather(rows)
    differ = [key for i, key in enumerate(keys) if len({g[i] for g in gathered}) > 1]
    if differ:
        raise ReplicaMismatch(
            f"after the restore, {', '.join(differ)} differ across ranks although they must be "
            "identical (data-parallel replicas): refusing to train diverged copies. Check that "
            "every rank builds the same model and that no rank restored another job's snapshot")


@dataclasses.dataclass
class RestoreResult:
    """What :meth:`Checkpointer.restore` did.

    Attributes:
        step: the step restored (0 for a fresh start).
        generation: the restored snapshot's generation.
        next_generation: the generation new snapshots carry.
        source: "local" (this node's RAM), "peer" (bytes copied from another node's RAM, or a
            replica of another node's shard held here), "persistent", or "none".
        seconds, nbytes: time and bytes this rank spent restoring.
        steps_lost: newest step any rank had reached (as far as known) minus ``step``.
        refused: snapshots refused (or lost) on the way, with the reason.
        saved_world_size: the world size the restored snapshot was taken at (differs from the
            current one after a shrink); 0 for a fresh start.
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


class Collective(Protocol):
    """The two collectives restore needs (so tests can simulate ranks without torch.distributed)."""

    def all_gather(self, rows: list[Version]) -> list[list[Version]]: ...
    def all_true(self, flag: bool) -> bool: ...


class Solo:
    """One process, no process group."""

    def all_gather(self, rows: list[Version]) -> list[list[Version]]:
        return [list(rows)]

    def all_true(self, flag: bool) -> bool:
        return flag


class TorchCollective:
    """Over the default (already initialised) process group, with int64 tensors only."""

    def __init__(self, group: Any = None, max_rows: int = 64) -> None:
        import torch.distributed as dist

        self.dist, self.group, self.max_rows = dist, group, max_rows
        backend = dist.get_backend(group)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                       else torch.device("cpu"))

    def all_gather(self, rows: list[Version]) -> list[list[Version]]:
        mine = torch.full((self.max_rows, 2), -1, dtype=torch.int64)
        for i, row in enumerate(rows[: self.max_rows]):
            mine[i, 0], mine[i, 1] = row
        mine = mine.to(self.device)
        out = [torch.empty_like(mine) for _ in range(self.dist.get_world_size(self.group))]
        self.dist.all_gather(out, mine, group=self.group)
        return [[(int(g), int(s)) for g, s in o.cpu().tolist()] for o in out]

    def all_true(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())


@dataclasses.dataclass
class _Fetched:
    tensors: list[torch.Tensor]
    meta: dict[str, Any]
    source: str
    nbytes: int
    names: list[str] = dataclasses.field(default_factory=list)
    #: The other old ranks' snapshots this rank's new shards need (sharded state).
    others: list["_Fetched"] = dataclasses.field(default_factory=list)
    #: Why the sharded state cannot be placed into this state ("" when it can).
    error: str = ""
    #: Lets go of the slot a piece read in place maps (its tensors are views of it).
    release: Callable[[], None] | None = None

    def close(self) -> None:
        """Releases the slots the other pieces were read from in place."""
        for other in self.others:
            if other.release is not None:
                other.release()
                other.release, other.tensors = None, []


class Sources:
    """Where this rank can find its shards: the daemon (may be None) and the persistent tier."""

    def __init__(self, transport: Any, job: str, rank: int, world_size: int,
                 persist_dir: str | None = None) -> None:
        self.transport, self.job, self.rank, self.world = transport, job, rank, world_size
        self.persist_dir = persist_dir
        self.ram: set[Version] = set()
        #: Complete steps of the persistent tier, and the world size each was saved at (any:
        #: at another one, the state is resharded from them as from peers' RAM).
        self.persisted: set[Version] = set()
        self.persisted_world: dict[Version, int] = {}
        self.progress: Version | None = None
        self.committed: Version | None = None
        self.committed_world = 0
        #: Versions worth asking the daemon to fetch from peers (the committed ones).
        self.fetchable: set[Version] = set()
        #: Why this rank's daemon could not be asked (it did not answer), or "".
        self.unreachable = ""

    def discover(self) -> list[Version]:
        """Asks the daemon (and lists the tier); returns every version reachable, newest first."""
        if self.transport is not None:
            try:
                info = self.transport.call("ckpt_list", job=self.job, rank=self.rank,
                                           world_size=self.world)
                self.ram = {tuple(v) for v in info.get("ram", {}).get(str(self.rank), [])}
                self.persisted = {tuple(v) for v in info.get("persisted", [])}
                self._saved_by(info.get("persisted_worlds"))
                self.progress = tuple(info["progress"]) if info.get("progress") else None
                self.persist_dir = self.persist_dir or info.get("persist_root")
            except DaemonUnavailable as exc:
                self.unreachable = str(exc)
                log.error("elasticd: rank %d cannot reach its daemon: %s", self.rank, exc)
                return []
            except Exception as exc:  # noqa: BLE001 — it refused: the tier may still help
                log.warning("elasticd: cannot list snapshots held by the daemon (%s)", exc)
            self._discover_committed()
        if self.persist_dir and not self.persisted:
            try:
                self._saved_by([[*m.version(), m.world_size] for m in
                                Tier(self.persist_dir).complete_steps(self.job)])
            except (OSError, TierError) as exc:
                log.warning("elasticd: cannot list the persistent tier %s: %s",
                            self.persist_dir, exc)
        for version in self.persisted:
            self.persisted_world.setdefault(version, self.world)
        return sorted(self.ram | self.persisted, reverse=True)

    def _saved_by(self, rows: Any) -> None:
        """Takes in the tier's steps of every world size: [[generation, step, world], ...]."""
        if not isinstance(rows, list):
            return  # an older daemon: only the current world size's steps are known
        for row in rows:
            if (isinstance(row, list) and len(row) == 3
                    and all(type(x) is int and x >= 0 for x in row) and row[2] > 0):
                self.persisted.add((row[0], row[1]))
                self.persisted_world[(row[0], row[1])] = row[2]

    def saved_world(self, version: Version) -> int:
        """The world size ``version`` was saved at, as far as this rank's sources say."""
        if version in self.ram:
            return self.world
        return self.persisted_world.get(version, self.world)

    def _discover_committed(self) -> None:
        try:
            info = self.transport.call("ckpt_committed", job=self.job)
        except Exception as exc:  # noqa: BLE001 — an older daemon, or etcd trouble: local only
            log.info("elasticd: no committed step from the daemon (%s)", exc)
            return
        ranks = info.get("ranks") if isinstance(info, dict) else None
        if info.get("committed", ...) is None or not isinstance(ranks, list) or not ranks:
            return
        try:
            self.committed = (int(info["generation"]), int(info["step"]))
            self.committed_world = max(int(r) for r in ranks) + 1
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("elasticd: ignoring a malformed committed step %r: %s", info, exc)
            self.committed, self.committed_world = None, 0

    def fetch(self, version: Version, refused: list[str],
              world: int | None = None) -> _Fetched | None:
        """This rank's shard of ``version``, copied into new tensors, or None.

        Args:
            world: the world size ``version`` was saved at (default: the current one); at
                another world size this rank loads old rank ``rank % world``'s shard.
        """
        world = self.world if world is None else world
        if world == self.world and version in self.ram:
            try:
                return self._from_daemon("ckpt_open", version, world, refused)
            except DaemonUnavailable as exc:
                return self._silent(version, exc)
            except Exception as exc:  # noqa: BLE001 — refused or vanished: try the next source
                refused.append(f"local step {version}: {exc}")
                log.error("elasticd: REFUSED the in-RAM snapshot of rank %d step %s: %s",
                          self.rank, version, exc)
        if version in self.fetchable and self.transport is not None:
            try:
                got = self._from_daemon("ckpt_fetch", version, world, refused,
                                        self.rank % world)
                if got is not None:
                    return got
            except DaemonUnavailable as exc:
                return self._silent(version, exc)
            except Exception as exc:  # noqa: BLE001 — no copy reachable: try the next source
                refused.append(f"peer step {version}: {exc}")
                log.error("elasticd: cannot fetch rank %d step %s from a peer: %s",
                          self.rank, version, exc)
        if version in self.persisted and self.persist_dir:
            try:
                # At another world size, old rank ``rank % world``'s (fetch_shards adds the
                # rest); Tier.read checks the file against the step's manifest.
                snap = Tier(self.persist_dir).read(self.job, version, self.rank % world)
                return _Fetched(read_tensors(snap.buffer, snap.layout), snap.meta, "persistent",
                                snap.layout.total_size, [e.name for e in snap.layout.entries])
            except (SnapshotError, TierError, OSError, ValueError) as exc:
                refused.append(f"persistent step {version}: {exc}")
                log.error("elasticd: REFUSED the persisted snapshot of rank %d step %s: %s",
                          self.rank, version, exc)
        return None

    def fetch_rank(self, version: Version, rank: int, refused: list[str],
                   world: int, in_place: bool = False) -> _Fetched | None:
        """Old rank ``rank``'s snapshot of ``version`` (saved by ``world`` ranks), for the
        shards of this rank's new local tensors: from this node's RAM, else copied from a
        peer's (``ckpt_fetch`` does both), else the persistent tier; None when none has it.
        ``in_place``: from the daemon, as views of its slot (see :meth:`_from_daemon`)."""
        if self.transport is not None and version in self.fetchable:
            try:
                got = self._from_daemon("ckpt_fetch", version, world, refused, rank,
                                        in_place=in_place)
                if got is not None:
                    return got
            except DaemonUnavailable as exc:
                return self._silent(version, exc)
            except Exception as exc:  # noqa: BLE001 — not reachable: try the persistent tier
                refused.append(f"rank {rank} step {version}: {exc}")
                log.error("elasticd: cannot fetch rank %d step %s: %s", rank, version, exc)
        if self.persist_dir:
            try:
                snap = Tier(self.persist_dir).read(self.job, version, rank)
                if snap.world_size == world:
                    return _Fetched(read_tensors(snap.buffer, snap.layout), snap.meta,
                                    "persistent", snap.layout.total_size,
                                    [e.name for e in snap.layout.entries])
            except (SnapshotError, TierError, OSError, ValueError) as exc:
                refused.append(f"persistent rank {rank} step {version}: {exc}")
        return None

    def fetch_shards(self, got: _Fetched, version: Version, refused: list[str], world: int,
                     state: Any) -> _Fetched | None:
        """Adds to ``got`` (old rank ``rank % world``'s snapshot) the other old ranks'
        snapshots that this rank's new shards need; the same code at every world size (at
        the same one, and on the same mesh, none). None when one of them is not reachable."""
        from elasticd.worker import shards

        dtensors = next(dtensor_nodes(got.meta), None) is not None
        # A ZeroRedundancyOptimizer partitions whole parameters by size: at another world size
        # a rank's new partition draws on any old rank's, so it needs every old snapshot.
        zero = world != self.world and any(
            kind == "zero" for _, kind, _ in got.meta.get("objects", ()))
        if not dtensors and not zero:
            return got
        base = self.rank % world
        need = [base, *(q for q in range(world) if q != base)] if zero else [base]
        if dtensors:
            try:
                more = shards.needed_ranks(got.meta, world, base, shards.live_meshes(state))
            except shards.ShardError as exc:
                got.error = str(exc)  # reported at the load, together on every rank
                return got
            need += [q for q in more if q not in need]
        for rank in need[1:]:
            # Only the resharder reads the other pieces, copying the rows it needs: they are
            # read in place, not copied out whole first (a ZeRO state keeps what it is given).
            other = self.fetch_rank(version, rank, refused, world, in_place=not zero)
            if other is None:
                got.close()
                return None
            got.others.append(other)
            got.nbytes += other.nbytes
            if other.source == "peer":
                got.source = "peer"
        return got

    def why_unreachable(self) -> str:
        """`` (why this rank's daemon did not answer)``, or "" when it did."""
        return f" ({self.unreachable})" if self.unreachable else ""

    def _silent(self, version: Version, exc: Exception) -> None:
        """The daemon did not answer: not a refusal of ``version`` (see :func:`restore`)."""
        self.unreachable = str(exc)
        log.error("elasticd: rank %d: the daemon did not answer while restoring step %s: %s",
                  self.rank, version, exc)

    def _from_daemon(self, op: str, version: Version, world: int, refused: list[str],
                     rank: int | None = None, in_place: bool = False) -> _Fetched | None:
        """Maps the slot ``op`` (``ckpt_open`` or ``ckpt_fetch``) points at and copies it out;
        None when the daemon says every copy is lost. ``rank``: whose shard (default: this
        rank's; another one's after a grow). ``in_place``: the tensors are read-only views of
        the mapping instead, and the slot stays mapped and pinned until the piece's
        ``release`` (a copy of a whole old snapshot cost as much as the reshard itself)."""
        rank = self.rank if rank is None else rank
        wait = {"timeout": FETCH_WAIT} if op == "ckpt_fetch" else {}
        reply = self.transport.call(op, job=self.job, rank=rank,
                                    generation=version[0], step=version[1], **wait)
        if reply.get("lost"):
            refused.append(f"peer step {version}: lost ({reply.get('reason', '')})")
            log.error("elasticd: rank %d step %s is lost in every peer's RAM: %s", rank,
                      version, reply.get("reason", ""))
            return None
        source = "peer" if reply.get("source") == "peer" else "local"
        mm = None
        try:
            with handed_fd(reply) as fd:  # the file the daemon verified, not what a path names
                mm = map_fd(fd, int(reply["offset"]) + int(reply["size"]), writable=False,
                            populate=False)
            reader = SnapshotReader(memoryview(mm), job=self.job, rank=rank,
                                    world_size=world, verify=False, where=reply["path"])
            if reader.header.version() != version:  # the daemon verified this very slot
                raise SnapshotError(f"slot holds step {reader.header.version()}")
            lay = reader.header.layout
            tensors = tensor_views(mm, lay) if in_place else read_tensors(mm, lay)
            out = _Fetched(tensors, reader.header.meta, source,
                           lay.total_size, [e.name for e in lay.entries])
            del reader
            if in_place:
                # The piece's views need the mapping, and the slot its pin, until released.
                out.release = functools.partial(self._release, reply["pin"], mm)
                mm = None
            return out
        finally:
            if mm is not None or not in_place:
                self._release(reply["pin"], mm)

    def _release(self, pin: int, mm: mmap.mmap | None = None) -> None:
        """Unmaps a slot (once no view is left) and tells the daemon it may reuse it."""
        if mm is not None:
            _unmap(mm)
        try:
            self.transport.call("ckpt_release", pin=pin)
        except Exception as exc:  # noqa: BLE001 — the daemon drops stale pins itself
            log.debug("elasticd: ckpt_release failed: %s", exc)


def _unmap(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a view is still referenced; unmapped when the last one goes
        pass


def close_fds(reply: dict[str, Any]) -> None:
    """Closes the descriptors a daemon reply handed over (a reply that will not be used)."""
    for fd in reply.pop("_fds", None) or ():
        os.close(fd)


@contextlib.contextmanager
def handed_fd(reply: dict[str, Any]) -> Iterator[int]:
    """The one descriptor a daemon reply handed over (a slot file), closed on leaving; any
    other descriptor in the reply is closed too.

    Raises:
        RuntimeError: the reply carries no descriptor, or several.
    """
    fds = reply.pop("_fds", None) or []
    try:
        if len(fds) != 1:
            raise RuntimeError(f"the daemon handed over {len(fds)} descriptors for the slot, "
                               "not 1 (an elasticd older than this worker?)")
        yield fds[0]
    finally:
        for fd in fds:
            os.close(fd)


# Rows every rank sends ahead of its versions: its progress, the committed version it was told
# of, (world size of that committed version, 1: the slot that said whether its state could be
# restored at another world size, which every state elasticd snapshots now can), and (1 if its
# daemon did not answer, 0).
_HEAD = 4


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What the ranks agreed to try.

    Attributes:
        candidates: (version, world size it was saved at), newest first.
        seen: the newest version any rank knows of, or None.
    """

    candidates: list[tuple[Version, int]]
    seen: Version | None


def agree(sources: Sources, collective: Collective, state: Any = None) -> Agreement:
    """The versions to try on every rank (identical on all of them) and the newest seen."""
    mine = sources.discover()
    head = [sources.progress or _NONE, sources.committed or _NONE,
            (sources.committed_world or -1, 1),
            (1 if sources.unreachable else 0, 0)]
    gathered = collective.all_gather(head + mine)
    silent = [rank for rank, rows in enumerate(gathered) if rows[3][0] == 1]
    if silent:
        raise DaemonUnreachable(
            f"the elasticd daemon of rank(s) {', '.join(map(str, silent))} does not answer"
            f"{sources.why_unreachable()}: restoring "
            "without it could start over from an older step than the committed one, so this "
            "attempt fails on every rank and the agent starts another once that node is fenced "
            "or its daemon answers again")
    seen = [v for rows in gathered for v in rows[:2] + rows[_HEAD:] if v != _NONE]
    common = set.intersection(*({v for v in rows[_HEAD:] if v != _NONE} for rows in gathered))
    candidates = {v: sources.saved_world(v) for v in common}
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
    ordered = sorted(candidates.items(), reverse=True)
    return Agreement(ordered, max(seen, default=None))


def restore(state: Any, sources: Sources, collective: Collective, clock: Any,
            replicated: list[str] = ()) -> RestoreResult:
    """Runs the whole protocol on this rank; see the module docstring.

    Args:
        replicated: entries that must be identical on every rank; compared by checksum
            after a restore (:func:`check_replicas_agree`).

    Raises:
        RestoreError: on every rank, when the agreed snapshot does not fit some rank's state.
        ReplicaMismatch: on every rank, when ``replicated`` entries differ after it.
    """
    from elasticd.worker.state import StateError, load_into

    start = clock()
    result = RestoreResult()
    agreed = agree(sources, collective, state)
    seen = agreed.seen
    for version, world in agreed.candidates:
        got = sources.fetch(version, result.refused, world)
        if got is not None:
            got = sources.fetch_shards(got, version, result.refused, world, state)
        try:
            if not collective.all_true(not sources.unreachable):
                # A daemon that does not answer a fetch may still hold the step: trying older
                # ones would end, in the worst case, in a fresh start while it is committed.
                raise DaemonUnreachable(
                    f"a rank's elasticd daemon did not answer while fetching step {version}"
                    f"{sources.why_unreachable()}: this "
                    "attempt fails on every rank and the agent starts another")
            if not collective.all_true(got is not None):
                log.warning("elasticd: step %s is not loadable on every rank; trying an older "
                            "one", version)
                continue
            assert got is not None
            error = got.error
            try:
                if not error:
                    load_into(state, got.tensors, got.meta, names=got.names,
                              others=[(o.names, o.tensors, o.meta) for o in got.others])
            except StateError as exc:
                error = str(exc)
            if not collective.all_true(not error):
                raise RestoreError(f"snapshot {version} could not be loaded on every rank"
                                   f"{': ' + error if error else ''}")
            result.step, result.generation = version[1], version[0]
            result.source, result.nbytes = got.source, got.nbytes
            result.saved_world_size = world
            if world != sources.world:
                log.warning("elasticd: rank %d restored step %s saved by %d ranks into a world "
                            "of %d (old rank %d's snapshot%s)", sources.rank, version, world,
                            sources.world, sources.rank % world,
                            f" and {len(got.others)} more: resharded" if got.others
                            else ": the state is replicated")
            break
        finally:
            if got is not None:
                got.close()  # the pieces read in place: their slots go back
    if result.source != "none":
        check_replicas_agree(state, list(replicated), collective)
    result.next_generation = seen[0] + 1 if seen is not None else 0
    result.steps_lost = max(0, seen[1] - result.step) if seen is not None else 0
    result.seconds = clock() - start
    log.info("elasticd: rank %d (pid %d) restored step %d (generation %d) from %s in %.3f s, "
             "%d bytes, %d steps lost; new snapshots use generation %d", sources.rank,
             os.getpid(), result.step, result.generation, result.source, result.seconds,
             result.nbytes, result.steps_lost, result.next_generation)
    return result
