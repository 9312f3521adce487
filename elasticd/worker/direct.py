"""A reshard's rows fetched by the worker itself, from the holders straight into its live
tensors, over replication sessions its daemon handed over.

Restored through the daemon, a reshard's rows cross three times on the fetching node: the
daemon receives them into restore scratch, the worker copies them into its live tensors, and
both processes pay for the pages in between (bench/results/restore41/: elasticd's path
1.26-1.58x the verified floor's CPU per restore, where a worker fetching its own rows ran
1.05-1.26x). Here the worker, for each old rank its new shards need:

1. asks its daemon for sessions to that copy's remote holders (``ckpt_sessions``: scoped to
   the job, described, handed over with ``SCM_RIGHTS``; the worker never holds the cluster
   secret; :mod:`elasticd.replication.handed`), or is told its own node holds the copy, which
   it then reads in place as before (``ckpt_fetch``);
2. fetches the copy's header into a staging buffer laid out like the snapshot (a ``memfd``
   mapping kept from restore to restore, :class:`StagingMaps`);
3. works out, with the resharder's own code and without copying anything
   (:func:`elasticd.worker.state.plan_rows`), which row copies the load would make straight
   into the live tensors' memory;
4. fetches the blocks its new shards need (and every block those rows lie in) with the
   daemon's own fetch (:func:`elasticd.recovery.fetch.fetch_shard`) into a
   :class:`~elasticd.replication.scatter.Scatter`: each planned row range lands in its live
   tensor, every other byte in staging, every block checked against its owner's tag as it
   lands, wherever it landed;
5. and hands the pieces to the normal load (:func:`elasticd.worker.state.load_into`), whose
   row copies already made are skipped (:class:`~elasticd.worker.slot_rows.Landed`).

Anything that goes wrong before the load (a daemon without the operation, TLS replication,
no session, a holder lost with no other to take its blocks, a block that fails its tag)
gives None: the restore takes the daemon's path as before. Rows a failed fetch had already
landed in the live tensors are overwritten by whatever the restore loads next; :attr:`tainted`
says they are there, so a restore that then loads nothing fails instead of training on them
(:func:`elasticd.worker.restore.restore`). GPU destinations are never routed (the plan routes
host memory only): their rows land in staging and the load copies them as before.

Worker side; it runs the replication client (its fetch, its sessions) but never the daemon's
store or secret.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
from typing import Any, Callable, Sequence

from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.errors import CheckpointError
from elasticd.recovery.fetch import fetch_shard
from elasticd.recovery.ranges import blocks_holding, needed_blocks, parse_boxes
from elasticd.replication.deadline import LinkRates
from elasticd.replication.handed import HandedConnections, Ticket, adopt
from elasticd.replication.scatter import Scatter
from elasticd.snapshot.format import SnapshotHeader, dtensors_only
from elasticd.snapshot.reader import parse_header
from elasticd.worker import shards
from elasticd.worker.copier import tensor_views
from elasticd.worker.fetched import Fetched, own_unsharded
from elasticd.worker.slot_rows import Landed, RowCopy, SlotFiles, mapping_address
from elasticd.worker.state import plan_rows

log = logging.getLogger("elasticd.checkpoint")

Version = tuple[int, int]
#: Seconds the daemon keeps the sessions it hands over before cutting them off: the fetch's
#: own deadlines (from the measured link rates) end a stalled one well before.
SESSION_SECONDS = 600.0


class Staging:
    """One old rank's staging buffer: a ``memfd`` mapping, kept (its pages touched) and grown
    as needed."""

    def __init__(self) -> None:
        self.fd = -1
        self.mm: mmap.mmap | None = None

    def take(self, size: int) -> mmap.mmap:
        """A writable mapping of at least ``size`` bytes (the kept one when it is large
        enough)."""
        if self.mm is None or len(self.mm) < size:
            self.close()
            fd = os.memfd_create("elasticd-staging", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                self.mm = mmap.mmap(fd, size)
            except BaseException:
                os.close(fd)
                raise
            self.fd = fd
        return self.mm

    def close(self) -> None:
        if self.mm is not None:
            mm, fd, self.mm, self.fd = self.mm, self.fd, None, -1
            os.close(fd)
            with contextlib.suppress(BufferError):  # a view still held: unmapped when dropped
                mm.close()


class StagingMaps:
    """The worker process's staging buffers, by old rank (one restore at a time uses them)."""

    def __init__(self) -> None:
        self._by_rank: dict[int, Staging] = {}

    def of(self, rank: int) -> Staging:
        return self._by_rank.setdefault(rank, Staging())

    def close(self) -> None:
        for staging in self._by_rank.values():
            staging.close()
        self._by_rank.clear()


#: The worker process's staging buffers (kept from one restore to the next, as restore
#: scratch's mappings are: :mod:`.scratch_maps`).
STAGING = StagingMaps()
#: The link rates the worker process measured, kept from one restore to the next (as a
#: daemon keeps its own): later fetches size their pieces and deadlines from them.
RATES = LinkRates()


class Unsupported(CheckpointError):
    """The daemon hands no sessions over on this node (no peer replication, or replication
    over TLS): the daemon's path serves every reshard here, and that is no fallback."""


class _Remote:
    """One old rank's copy fetched over handed sessions: its holders, sessions and staging."""

    def __init__(self, rank: int, holders: list[str], connections: HandedConnections,
                 staging: Staging) -> None:
        self.rank, self.holders, self.connections = rank, holders, connections
        self.staging = staging
        self.header: SnapshotHeader | None = None
        self.mm: mmap.mmap | None = None
        #: The copy's descriptor, as its holder described it with the header.
        self.descriptor: Any = None


class DirectFetch:
    """A restoring rank's direct fetches (see the module docstring).

    Args:
        transport: the worker's client of its daemon's local socket.
        local: reads old rank ``q``'s copy (of the version being fetched) held on this node
            in place (``ckpt_fetch``), or None when it cannot.
        staging: where the staging buffers are kept (default: the process's).
        clock: times the fetch and its requests' deadlines.
    """

    def __init__(self, transport: Any, job: str, rank: int,
                 local: Callable[[int], Fetched | None],
                 staging: StagingMaps | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.transport, self.job, self.rank, self.local = transport, job, rank, local
        self.staging = staging if staging is not None else STAGING
        self.clock = clock
        self.rates = RATES
        #: A fetch that failed had landed rows in the live tensors already.
        self.tainted = False

    def fetch(self, version: Version, world: int, base: int, state: Any,
              boxes: Sequence[Any], refused: list[str]) -> Fetched | None:
        """Old rank ``base``'s snapshot of ``version`` (saved by ``world`` ranks) with every
        other old rank's the new shards need, their rows landed in ``state``'s own tensors,
        ready for the load; None when this path cannot serve (the reason in the log, and in
        ``refused`` when a copy failed its checks)."""
        if not boxes:
            return None  # no new local boxes to select blocks by (Sources.prepare failed)
        started = self.clock.perf_counter()
        remotes: list[_Remote] = []
        pieces: dict[int, Fetched] = {}
        try:
            got = self._piece(version, world, base, remotes, pieces)
            if not dtensors_only(got.meta):
                raise RuntimeError("its sharded state is not DTensors only")
            need = shards.needed_ranks(got.meta, world, base, shards.live_meshes(state))
            for q in need[1:]:
                self._piece(version, world, q, remotes, pieces)
            others = [pieces[q] for q in need[1:]]
            files = SlotFiles(p.slot_file for p in (got, *others) if p.slot_file)
            copies = plan_rows(state, got.tensors, got.meta, files, names=got.names,
                               others=[(o.names, o.tensors, o.meta) for o in others])
            routes = _routes(copies, {mapping_address(r.mm): r for r in remotes})
            wire = self._land(version, remotes, routes, parse_boxes(list(boxes)))
        except Exception as exc:  # noqa: BLE001 — any failure: the daemon's path instead
            if isinstance(exc, Unsupported):  # the node's set-up, not a failure: not refused
                log.info("elasticd: rank %d fetches step %s through its daemon: %s",
                         self.rank, version, exc)
            else:
                refused.append(f"direct fetch of step {version}: {exc}")
                log.warning("elasticd: rank %d fetches step %s through its daemon instead: %s",
                            self.rank, version, exc)
            for piece in pieces.values():
                piece.close()
            return None
        finally:
            for remote in remotes:
                remote.connections.close()
            self._done(remotes)
        got = own_unsharded(got)
        got.others = others
        got.source = "peer" if remotes else got.source
        got.nbytes = sum(p.nbytes for p in (got, *others))
        routed = [c for cs in routes.values() for c, _ in cs]
        got.files = Landed((p.slot_file for p in (got, *others) if p.slot_file), routed)
        if not remotes:
            return got  # every piece read in place from this node: nothing fetched
        got.figures = {"wire_bytes": wire, "routed_bytes": sum(c.nbytes for c in routed),
                       "old_ranks": len(need), "remote_ranks": len(remotes),
                       "seconds": round(self.clock.perf_counter() - started, 6)}
        log.info("elasticd: rank %d fetched step %s itself from %d old ranks' holders: %d "
                 "bytes on the wire, %d of them straight into its tensors", self.rank,
                 version, len(remotes), wire, got.figures["routed_bytes"])
        return got

    def _done(self, remotes: list[_Remote]) -> None:
        """Tells the daemon the sessions it handed over for ``remotes`` can end now, rather
        than at their deadline (each holds a descriptor in the daemon until then). Best
        effort: a daemon that does not answer keeps them to the deadline, nothing worse."""
        if not remotes:
            return
        try:
            self.transport.call("ckpt_sessions_done", job=self.job, rank=self.rank,
                                old_ranks=[remote.rank for remote in remotes])
        except Exception as exc:  # noqa: BLE001 — the restore goes on either way
            log.info("elasticd: rank %d could not end its handed sessions (they end at their "
                     "deadline): %s", self.rank, exc)

    def _piece(self, version: Version, world: int, q: int, remotes: list[_Remote],
               pieces: dict[int, Fetched]) -> Fetched:
        """Old rank ``q``'s copy: read in place when this node holds it, else its header
        fetched over handed sessions into staging (its payload comes in :meth:`_land`).

        Raises:
            RuntimeError: neither (other errors: those of the daemon's call and the fetch).
        """
        reply = self.transport.call("ckpt_sessions", job=self.job, rank=self.rank, old_rank=q,
                                    generation=version[0], step=version[1],
                                    seconds=SESSION_SECONDS)
        fds = list(reply.pop("_fds", None) or [])
        if reply.get("unsupported") and not fds:
            raise Unsupported(str(reply.get("reason", "its daemon hands no sessions over")))
        if reply.get("local"):
            for fd in fds:
                os.close(fd)
            got = self.local(q)
            if got is None:
                raise RuntimeError(f"old rank {q}'s copy on this node could not be read")
            pieces[q] = got
            return got
        sessions = reply.get("sessions")
        if not isinstance(sessions, list) or not sessions or len(sessions) != len(fds):
            for fd in fds:
                os.close(fd)
            raise RuntimeError(f"no session to a holder of old rank {q} "
                               f"({reply.get('reason', 'none handed over')})")
        clients, holders = {}, []
        for entry, fd in zip(sessions, fds):
            try:
                client = adopt(fd, Ticket.from_json(entry.get("ticket")))
            except (ValueError, OSError, AttributeError):
                os.close(fd)
                continue
            clients[client.peer_id] = client
            holders.append(client.peer_id)
        remote = _Remote(q, holders, HandedConnections(clients), self.staging.of(q))
        remotes.append(remote)

        def into(descriptor: Any) -> mmap.mmap:
            remote.mm = remote.staging.take(descriptor.total_bytes)
            return remote.mm

        remote.descriptor = self._fetch(version, remote, into, lambda header: []).descriptor
        assert remote.mm is not None
        header = parse_header(remote.mm, job=self.job, rank=q, world_size=world)
        if header.version() != version:
            raise RuntimeError(f"old rank {q}'s holders served step {header.version()}")
        remote.header = header
        lay = header.layout
        pieces[q] = Fetched(tensor_views(remote.mm, lay), header.meta, "peer", lay.total_size,
                            [e.name for e in lay.entries], rank=q,
                            slot_file=(mapping_address(remote.mm), remote.staging.fd,
                                       len(remote.mm)),
                            release=lambda: None)  # kept: the next restore lands there again
        return pieces[q]

    def _land(self, version: Version, remotes: list[_Remote],
              routes: dict[int, list[tuple[RowCopy, memoryview]]], boxes: Any) -> int:
        """Fetches every remote copy's needed blocks, routed; returns the bytes received."""
        wire = 0
        for remote in remotes:
            header, mm = remote.header, remote.mm
            assert header is not None and mm is not None
            mine = routes.get(mapping_address(mm), [])
            # Every routed row must land (and be checked): its blocks too, whatever the
            # boxes select.
            blocks = set(needed_blocks(header, boxes)) | set(blocks_holding(
                header, ((c.at, c.at + c.nbytes) for c, _ in mine)))
            scatter = Scatter(mm, [(c.at, to) for c, to in mine],
                              header_end=header.layout.data_offset)
            self.tainted = self.tainted or bool(mine)
            # Described with the header already: the holders serve the blocks at once.
            result = self._fetch(version, remote, scatter, lambda _h, b=sorted(blocks): b,
                                 described=(remote.descriptor, header))
            wire += int(result.wire_bytes)
        return wire

    def _fetch(self, version: Version, remote: _Remote, into: Any, select: Any,
               described: Any = None) -> Any:
        return fetch_shard(self.job, remote.rank, version, into, me="",
                           holders=remote.holders, connections=remote.connections, own=(),
                           clock=self.clock, rates=self.rates, select=select,
                           described=described)


def _routes(copies: list[RowCopy], remotes: dict[int, _Remote]
            ) -> dict[int, list[tuple[RowCopy, memoryview]]]:
    """The planned copies out of staging buffers, as routes (by mapping address): each a
    range of the snapshot after its header and inside the buffer, landing at the copy's
    destination. Copies whose source ranges overlap are not routed (a range lands in one
    place only, and the load copies those from staging)."""
    by_mapping: dict[int, list[RowCopy]] = {}
    for copy in copies:
        remote = remotes.get(copy.mapping)
        if remote is None or remote.header is None or not copy.nbytes:
            continue  # a copy read in place from this node's slot: the load makes it
        if copy.at < remote.header.layout.data_offset or copy.at + copy.nbytes > len(remote.mm):
            continue
        by_mapping.setdefault(copy.mapping, []).append(copy)
    out: dict[int, list[tuple[RowCopy, memoryview]]] = {}
    for mapping, found in by_mapping.items():
        found.sort(key=lambda c: c.at)
        clash = set()
        for a, b in zip(found, found[1:]):
            if b.at < a.at + a.nbytes:
                clash.update((a, b))
        out[mapping] = [(c, memoryview((ctypes.c_char * c.nbytes).from_address(c.into))
                         .cast("B")) for c in found if c not in clash]
    return out
