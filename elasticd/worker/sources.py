"""Where a restoring rank finds the pieces of a version: its daemon (this node's RAM, or a
peer's, which ``ckpt_fetch`` copies into this node's store first) and the persistent tier.

:class:`Sources` lists what each holds (for :func:`elasticd.worker.restore.agree`) and hands
:func:`elasticd.worker.restore.restore` a version's pieces: this rank's old shard, copied out
of the slot the daemon verified (mapped from the descriptor it passed, never by path), and for
sharded state the other old ranks' snapshots the new shards need, read in place. At another
world size the sharded entries of this rank's old shard are read in place too (the resharder
copies the rows it needs). Worker side: imports torch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import mmap
import os
import sys
import threading
from typing import Any, Iterator

import torch

from elasticd.persistence.tier import Tier, TierError
from elasticd.snapshot.format import SnapshotError, dtensor_nodes
from elasticd.snapshot.reader import SnapshotReader
from elasticd.snapshot.segment import map_fd
from elasticd.worker import handover, shards
from elasticd.worker.client import DaemonUnavailable
from elasticd.worker.copier import read_tensors, tensor_views
from elasticd.worker.fetched import Fetched, own_unsharded
from elasticd.worker.scratch_maps import SCRATCH_MAPS, ScratchMaps
from elasticd.worker.slot_rows import huge_page_file, mapping_address

log = logging.getLogger("elasticd.checkpoint")

Version = tuple[int, int]
#: Seconds a rank waits for the daemon's answer to ``ckpt_fetch``. The daemon bounds the
#: fetch itself, each request to a holder by a deadline from its bytes and the measured link
#: rate (elasticd.replication.deadline), and answers "lost" when no holder can serve; the
#: client's default 10 s would give up on a shard that simply takes longer to move (1 GiB at
#: the 50 MB/s assumed before a measurement) and fail the attempt on every rank, again at
#: every attempt. A daemon that stops answering altogether is the agent's to notice
#: (elasticd.agent.daemon_watch fences the node).
FETCH_WAIT = 1800.0


class Sources:
    """Where this rank can find its shards: the daemon (may be None) and the persistent tier."""

    #: Where restore scratch read in place is mapped (kept for the next restore): the
    #: process's, unless an instance is given its own.
    scratch_maps: ScratchMaps = SCRATCH_MAPS

    def __init__(self, transport: Any, job: str, rank: int, world_size: int,
                 persist_dir: str | None = None, previous: tuple[int, int] | None = None
                 ) -> None:
        self.transport, self.job, self.rank, self.world = transport, job, rank, world_size
        self.persist_dir = persist_dir
        #: (rank, world size) this process held in the round before, when it differs from
        #: the current one: a survivor of an in-process re-formation (see :attr:`own`), or
        #: the worker a fresh process replaces on its node (its agent restarted it there).
        self.previous = previous if previous != (rank, world_size) else None
        #: Versions of the previous rank's snapshots this node holds (saved at the previous
        #: world size): what this survivor can load from its own slot. Offered to the
        #: agreement; the versions every rank offers are :attr:`own_agreed`.
        self.own: set[Version] = set()
        #: The version this process's live state still is (:mod:`.held_state`), set by the
        #: Checkpointer; offered to the agreement only when this rank's slots hold it.
        self.held: Version | None = None
        #: Versions this rank loads from its own slot: those every rank offers, and one it
        #: hands over to ranks that lack it (:mod:`.handover`).
        self.own_agreed: set[Version] = set()
        #: The version whose own snapshot this rank sends to others: its bytes are kept.
        self.sending: Version | None = None
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
        #: A direct fetch that failed had landed rows in the live state (:mod:`.direct`).
        self.tainted = False
        #: This rank's new local boxes (shards.local_boxes, by :meth:`prepare`), sent with the
        #: fetches of a version saved at another world size so that only the rows it needs
        #: cross the network.
        self.boxes: list[list[Any]] | None = None

    def discover(self) -> list[Version]:
        """Asks the daemon (and lists the tier); returns every version reachable, newest first."""
        if self.transport is not None:
            # One call (the daemon is busy with the failure at this moment): this rank's
            # listing, the previous rank's own snapshots and the committed step together;
            # a daemon before those fields answers the listing alone, and is asked the rest
            # as it was (three calls).
            was = {} if self.previous is None else {
                "previous_rank": self.previous[0], "previous_world_size": self.previous[1]}
            info: Any = {}
            try:
                info = self.transport.call("ckpt_list", job=self.job, rank=self.rank,
                                           world_size=self.world, committed=True, **was)
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
            if "committed_step" in info:
                self._committed_from(info["committed_step"])
            else:
                self._discover_committed()
            if "own" in info and self.previous is not None:
                self._own_from(info["own"])
            else:
                self._discover_own()
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

    def _discover_own(self) -> None:
        """Lists the previous rank's snapshots at the previous world size (:attr:`own`)."""
        if self.previous is None or self.unreachable:
            return
        rank, world = self.previous
        try:
            info = self.transport.call("ckpt_list", job=self.job, rank=rank, world_size=world)
        except DaemonUnavailable as exc:
            self.unreachable = str(exc)
            log.error("elasticd: rank %d cannot reach its daemon: %s", self.rank, exc)
            return
        except Exception as exc:  # noqa: BLE001 — refused: no own offer
            log.warning("elasticd: cannot list rank %d's own snapshots (was rank %d of %d): %s",
                        self.rank, rank, world, exc)
            return
        self._own_from(info.get("ram", {}).get(str(rank), []) if isinstance(info, dict) else None)

    def _own_from(self, rows: Any) -> None:
        """Takes in the previous rank's versions (``ckpt_list``'s ``own``, or its listing of
        that rank); a malformed answer offers none."""
        try:
            self.own = {(int(g), int(s)) for g, s in rows}
        except (TypeError, ValueError) as exc:
            log.warning("elasticd: ignoring rank %d's own snapshots %.200r: %s", self.rank,
                        rows, exc)

    def held_offer(self) -> Version | None:
        """:attr:`held` when the daemon listed it in this rank's own slot (the rank it was,
        or, in the same place, its current rank's), else None (after :meth:`discover`)."""
        slots = self.own if self.previous is not None else self.ram
        return self.held if self.held in slots else None

    def saved_world(self, version: Version) -> int:
        """The world size ``version`` was saved at, as far as this rank's sources say."""
        return self.world if version in self.ram else self.persisted_world.get(version, self.world)

    def _discover_committed(self) -> None:
        try:
            info = self.transport.call("ckpt_committed", job=self.job)
        except Exception as exc:  # noqa: BLE001 — an older daemon, or etcd trouble: local only
            log.info("elasticd: no committed step from the daemon (%s)", exc)
            return
        self._committed_from(info)

    def _committed_from(self, info: Any) -> None:
        """Takes in a ``ckpt_committed`` answer (its own, or ``ckpt_list``'s
        ``committed_step``)."""
        if not isinstance(info, dict):
            return
        ranks = info.get("ranks")
        if info.get("committed", ...) is None or not isinstance(ranks, list) or not ranks:
            return
        try:
            self.committed = (int(info["generation"]), int(info["step"]))
            self.committed_world = max(int(r) for r in ranks) + 1
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("elasticd: ignoring a malformed committed step %r: %s", info, exc)
            self.committed, self.committed_world = None, 0

    def fetch(self, version: Version, refused: list[str], world: int | None = None,
              state: Any = None) -> Fetched | None:
        """This rank's shard of ``version``, copied into new tensors, or None.

        Args:
            world: the world size ``version`` was saved at (default: the current one); at
                another world size this rank loads old rank ``rank % world``'s shard (a
                survivor of an in-process re-formation: the rank it was, from its own slot), or,
                when no copy of that one is left in any node's RAM, another old rank's (the
                same model and optimizer for replicated state; the resharder takes the rows
                of sharded state from every old rank it needs either way). Otherwise the
                step is not loadable on this rank, and the job restores an older step, or
                step 0, while the committed step is in RAM on the survivors (a chaos run:
                old rank 0's copies on a frozen node and on the killed one).
            state: the live state, given for a reshard: the rows its new shards need are
                fetched straight into its tensors where they can be (:mod:`.direct`).
        """
        world = self.world if world is None else world
        if version in self.own_agreed:
            got = self._own_slot(version, refused)
            if got is not None:
                return got
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
            reshard = world != self.world
            base = self.rank % world  # this rank itself at the same world size
            if reshard and self.previous is not None and self.previous[1] == world:
                # A survivor of an in-process re-formation: the snapshot it wrote itself, in
                # its own node's RAM; the resharder takes the rows it lacks from the others.
                base = self.previous[0]
            if reshard and state is not None and direct_fetch_on():
                got = self._direct(version, world, base, state, refused)
                if got is not None:
                    return got
            for old in [(base + i) % world for i in range(world if reshard else 1)]:
                try:
                    got = self._from_daemon("ckpt_fetch", version, world, refused, old,
                                            in_place=reshard)
                except DaemonUnavailable as exc:
                    return self._silent(version, exc)
                except Exception as exc:  # noqa: BLE001 — no copy reachable: the next source
                    refused.append(f"peer step {version} rank {old}: {exc}")
                    log.error("elasticd: cannot fetch rank %d step %s from a peer: %s",
                              old, version, exc)
                    continue
                if got is None:
                    continue  # lost in every peer's RAM
                if not reshard:
                    return got
                if old != base:
                    log.warning("elasticd: rank %d restores step %s from old rank %d's "
                                "snapshot: no copy of old rank %d's is left in RAM",
                                self.rank, version, old, base)
                got.rank = old
                return own_unsharded(got)
        if version in self.persisted and self.persist_dir:
            try:
                # At another world size, old rank ``rank % world``'s (fetch_shards adds the
                # rest); Tier.read checks the file against the step's manifest.
                snap = Tier(self.persist_dir).read(self.job, version, self.rank % world)
                return Fetched(read_tensors(snap.buffer, snap.layout), snap.meta, "persistent",
                                snap.layout.total_size, [e.name for e in snap.layout.entries])
            except (SnapshotError, TierError, OSError, ValueError) as exc:
                refused.append(f"persistent step {version}: {exc}")
                log.error("elasticd: REFUSED the persisted snapshot of rank %d step %s: %s",
                          self.rank, version, exc)
        return None

    def preload(self, state: Any) -> None:
        """Starts importing the direct fetch (:mod:`.direct`: the replication client, 0.1-0.2 s
        of imports) in the background when ``state`` holds DTensors, so that a reshard after
        the agreement finds it loaded (the agreement waits on the daemon and the other ranks
        meanwhile); the import runs once per process."""
        if (self.transport is not None and direct_fetch_on()
                and "elasticd.worker.direct" not in sys.modules and shards.live_meshes(state)):
            threading.Thread(target=importlib.import_module, args=("elasticd.worker.direct",),
                             daemon=True, name="elasticd-preload").start()

    def _direct(self, version: Version, world: int, base: int, state: Any,
                refused: list[str]) -> Fetched | None:
        """Old rank ``base``'s snapshot with the others the new shards need, their rows
        fetched by this rank itself into ``state`` (:mod:`.direct`); None: the daemon's path."""
        if not shards.live_meshes(state):
            return None  # no DTensor to land rows in: a replicated state is fetched whole
        # Imported here: the replication client is no cost to a job that never reshards.
        from elasticd.worker.direct import DirectFetch

        self.prepare(state)
        direct = DirectFetch(self.transport, self.job, self.rank, lambda q: self._from_daemon(
            "ckpt_fetch", version, world, refused, q, in_place=True))
        try:
            return direct.fetch(version, world, base, state, self.boxes or [], refused)
        finally:
            self.tainted = self.tainted or direct.tainted

    def _own_slot(self, version: Version, refused: list[str]) -> Fetched | None:
        """The previous rank's snapshot of ``version`` from this node's RAM (verified by the
        daemon), or None: refused, gone, or sharded. A sharded snapshot (DTensors, a
        ZeroRedundancyOptimizer) holds only this rank's part of the state, and the dead
        ranks' parts of a step nobody committed may be held nowhere: such a state takes the
        committed step, as after a restart."""
        assert self.previous is not None
        rank, world = self.previous
        try:
            got = self._from_daemon("ckpt_open", version, world, refused, rank,
                                    keep_bytes=version == self.sending)
        except DaemonUnavailable as exc:
            return self._silent(version, exc)
        except Exception as exc:  # noqa: BLE001 — refused or evicted: the next source
            refused.append(f"own step {version} (rank {rank} of {world}): {exc}")
            log.error("elasticd: REFUSED this worker's own snapshot (rank %d of %d) of step "
                      "%s: %s", rank, world, version, exc)
            return None
        if got is None:
            return None
        if sharded(got.meta):
            got.close()
            refused.append(f"own step {version}: sharded state needs every old rank's shard")
            return None
        got.rank = rank
        return got

    def handed(self, got: Fetched | None, plan: handover.Handover, collective: Any,
               refused: list[str], world: int) -> Fetched | None:
        """``got`` on a holder of ``plan``'s version (after sending its bytes to the ranks
        it hands them to); on a rank that lacks the version, its holder's snapshot, checked
        block by block, or None (the holder had none, or the bytes fail the check)."""
        version, holder = plan.version, plan.holder_of(self.rank)
        data = handover.exchange(plan, self.rank, None if got is None else got.raw, collective)
        if holder is None:
            if got is not None:
                got.raw = None  # sent: the copies in got.tensors are what loads
            return got
        if data is None:
            refused.append(f"handed step {version}: rank {holder} had no copy to give")
            return None
        try:
            reader = SnapshotReader(memoryview(data.numpy()), job=self.job, world_size=world,
                                    where=f"step {version} handed over by rank {holder}")
            if reader.header.version() != version:
                raise SnapshotError(f"holds step {reader.header.version()}")
            lay = reader.header.layout
            out = Fetched(read_tensors(data.numpy(), lay), reader.header.meta, "peer",
                           lay.total_size, [e.name for e in lay.entries])
            out.rank = reader.header.rank
        except (SnapshotError, ValueError) as exc:
            refused.append(f"handed step {version} from rank {holder}: {exc}")
            log.error("elasticd: REFUSED step %s handed over by rank %d: %s", version, holder,
                      exc)
            return None
        log.info("elasticd: rank %d takes step %s from rank %d (old rank %d's snapshot): it "
                 "had not completed it", self.rank, version, holder, out.rank)
        return out

    def prepare(self, state: Any) -> None:
        """Works out this rank's new local boxes once (:attr:`boxes`), before fetching a
        version saved at another world size."""
        if self.boxes is not None:
            return
        try:
            self.boxes = shards.local_boxes(state)
        except Exception as exc:  # noqa: BLE001 — an optimisation: fetch whole instead
            log.warning("elasticd: rank %d fetches whole old snapshots: %s", self.rank, exc)
            self.boxes = []

    def fetch_rank(self, version: Version, rank: int, refused: list[str],
                   world: int, in_place: bool = False) -> Fetched | None:
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
                    return Fetched(read_tensors(snap.buffer, snap.layout), snap.meta,
                                    "persistent", snap.layout.total_size,
                                    [e.name for e in snap.layout.entries])
            except (SnapshotError, TierError, OSError, ValueError) as exc:
                refused.append(f"persistent rank {rank} step {version}: {exc}")
        return None

    def fetch_shards(self, got: Fetched, version: Version, refused: list[str], world: int,
                     state: Any) -> Fetched | None:
        """Adds to ``got`` (old rank ``rank % world``'s snapshot) the other old ranks'
        snapshots that this rank's new shards need; the same code at every world size (at
        the same one, and on the same mesh, none). None when one of them is not reachable."""
        if got.files is not None:  # every piece in hand already (:mod:`.direct`)
            return got
        dtensors = next(dtensor_nodes(got.meta), None) is not None
        # A ZeroRedundancyOptimizer partitions whole parameters by size: at another world size
        # a rank's new partition draws on any old rank's, so it needs every old snapshot.
        zero = world != self.world and any(
            kind == "zero" for _, kind, _ in got.meta.get("objects", ()))
        if not dtensors and not zero:
            return got
        base = got.rank if got.rank is not None else self.rank % world
        need = [base, *(q for q in range(world) if q != base)] if zero else [base]
        if dtensors:
            try:
                more = shards.needed_ranks(got.meta, world, base, shards.live_meshes(state))
            except shards.ShardError as exc:
                got.error = str(exc)  # reported at the load, together on every rank
                return got
            need += [q for q in more if q not in need]
        self.prepare(state)
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
                     rank: int | None = None, in_place: bool = False,
                     keep_bytes: bool = False) -> Fetched | None:
        """Maps the slot ``op`` (``ckpt_open`` or ``ckpt_fetch``) points at and copies it out;
        None when the daemon says every copy is lost. ``rank``: whose shard (default: this
        rank's; another one's after a grow). ``in_place``: the tensors are read-only views of
        the mapping instead, and the slot stays mapped and pinned until the piece's
        ``release`` (a copy of a whole old snapshot cost as much as the reshard itself); a
        ``ckpt_fetch`` then sends the new local boxes (:attr:`boxes`), and a copy fetched from
        peers is partial: only the rows they overlap, and every entry that is not a DTensor,
        are valid, which is all a reshard reads. Such a copy (restore scratch) is mapped
        through :attr:`scratch_maps`, which keeps the mapping past the release. ``keep_bytes``: the slot's bytes are copied
        out whole first (:attr:`Fetched.raw`, to hand over) and the tensors from that copy."""
        rank = self.rank if rank is None else rank
        wait: dict[str, Any] = {"timeout": FETCH_WAIT} if op == "ckpt_fetch" else {}
        if in_place and self.boxes and op == "ckpt_fetch":
            wait["need"] = self.boxes
        reply = self.transport.call(op, job=self.job, rank=rank,
                                    generation=version[0], step=version[1], **wait)
        if reply.get("lost"):
            refused.append(f"peer step {version}: lost ({reply.get('reason', '')})")
            log.error("elasticd: rank %d step %s is lost in every peer's RAM: %s", rank,
                      version, reply.get("reason", ""))
            return None
        source = "peer" if reply.get("source") == "peer" else "local"
        # Restore scratch (a partial copy) read in place: through the mapping kept from the
        # last restore, whose pages the daemon's next copy lands in (scratch_maps.py).
        scratch = in_place and bool(reply.get("partial"))
        mm, kept, handed, huge = None, None, False, 0
        try:
            with handed_fd(reply) as fd:  # the file the daemon verified, not what a path names
                size = int(reply["offset"]) + int(reply["size"])
                mm = (self.scratch_maps.map(fd, size) if scratch
                      else map_fd(fd, size, writable=False, populate=False))
                if in_place:  # the resharder reads rows from the file (slot_rows.py)
                    kept = os.dup(fd)
                    # Copied out of the mapping: a kept one, or a slot on huge pages.
                    huge = len(mm) if scratch or huge_page_file(fd) else 0
            reader = SnapshotReader(memoryview(mm), job=self.job, rank=rank,
                                    world_size=world, verify=False, where=reply["path"])
            if reader.header.version() != version:  # the daemon verified this very slot
                raise SnapshotError(f"slot holds step {reader.header.version()}")
            lay = reader.header.layout
            raw = None
            if keep_bytes:
                raw = torch.empty(lay.total_size, dtype=torch.uint8)
                with memoryview(mm) as whole:
                    raw.numpy()[:] = whole[:lay.total_size]
            tensors = (tensor_views(mm, lay) if in_place
                       else read_tensors(mm if raw is None else raw.numpy(), lay))
            out = Fetched(tensors, reader.header.meta, source,
                           lay.total_size, [e.name for e in lay.entries], raw=raw)
            del reader
            if in_place:
                # The piece's views need the mapping, its rows the descriptor, and the slot
                # its pin, until released.
                out.slot_file = (mapping_address(mm), kept, huge)
                out.release = functools.partial(self._release, reply["pin"],
                                                None if scratch else mm, kept)
                mm, kept, handed = None, None, True
            return out
        finally:
            if kept is not None:
                os.close(kept)
            if not handed:  # copied out, or failed before the piece took the slot: let it go
                self._release(reply["pin"], None if scratch else mm)

    def _release(self, pin: int, mm: mmap.mmap | None = None, fd: int | None = None) -> None:
        """Unmaps a slot (once no view is left), closes the piece's descriptor of it, and
        tells the daemon it may reuse it: one-way (nothing reads the reply, and a call waited
        for a daemon busy with the recovery, in the middle of a restore); as a call when the
        send was dropped."""
        if fd is not None:
            os.close(fd)
        if mm is not None:
            with contextlib.suppress(BufferError):  # a view still held: unmapped when dropped
                mm.close()
        try:
            if not self.transport.send("ckpt_release", pin=pin):
                self.transport.call("ckpt_release", pin=pin)
        except Exception as exc:  # noqa: BLE001 — the daemon drops stale pins itself
            log.debug("elasticd: ckpt_release failed: %s", exc)


def direct_fetch_on() -> bool:
    """Whether a reshard's rows are fetched by the rank itself (:mod:`.direct`):
    ``ELASTICD_DIRECT_FETCH=0`` in the job's environment keeps the daemon's path."""
    return os.environ.get("ELASTICD_DIRECT_FETCH", "1") != "0"


def sharded(meta: Any) -> bool:
    """Whether a state's meta holds sharded entries (FSDP2's DTensors, a
    ZeroRedundancyOptimizer): each rank's snapshot is only its part of the state."""
    return next(dtensor_nodes(meta), None) is not None or any(
        kind == "zero" for _, kind, _ in meta.get("objects", ()))


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
