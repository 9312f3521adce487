"""Spike (issue 30, restore41): a worker that fetches its own rows, in the sharded bench.

restore40 sized the one lever left for the sharded CPU point, a worker that receives its own
rows instead of copying them out of the daemon's restore scratch, with a model of both paths
(``worker_receive.py``: 0.67-0.72x the receive-plus-copy CPU). This runs the design's third
layer inside ``bench_sharded_restore.py --spike-worker-fetch``, with the product's own code on
every step that moves or checks a byte:

1. The worker opens its own replication sessions to the holders (``lanes.Connections``,
   scoped to the job: ``Hello.scope``). **Test-only:** it is given the cluster secret, which
   a job's process must never hold; the design's second layer (the daemon opening scoped
   sessions and handing them over) is what a product would do instead.
2. It fetches each needed old rank's header (``fetch_shard`` with no block selected) into a
   private staging buffer laid out like the snapshot (a ``memfd`` mapping kept from restore to
   restore, as restore scratch is kept).
3. **The plan**, from the product's resharder: ``state.plan_rows`` over the staging buffers,
   each row copy the load would make (``SlotFiles.locate``: which old snapshot, which bytes,
   which address), none made. (restore41's runs used a dry run of ``load_into`` with a
   recording ``SlotFiles`` instead; restore42 replaced it with the product's plan-only pass.)
4. **The fetch**: ``fetch_shard`` for each needed old rank, the product's block selection
   (``ranges.needed_blocks`` of the worker's boxes, as the daemon selects), into a
   ``Scatter`` whose routes are the recorded copies: each row lands in its live tensor
   straight from the socket, every other byte of its block in staging, every block checked
   against its owner's tag as it lands (``RunCheck``; split blocks streamed).
5. ``load_into``, with the product's ``slot_rows.Landed``, which makes no planned copy (the
   rows are in place) and leaves the rest (the entries that are not sharded, from staging) to the
   product's path.

What it leaves out, and so how its figures lean: the restore's agreement (the ranks' rows
gathered, a daemon call each: the elasticd variant pays it, this one does not); the daemon's
bookkeeping of a fetch (counters, placement); the handover (layer 2: a local-socket call and
``SCM_RIGHTS`` per holder, small). What it adds: the plan (timed apart here as
``plan_seconds``) and a second describe and header request per old rank, as the product's
``elasticd/worker/direct.py`` does too. Since restore42 the product's path is this design
with the sessions handed over by the daemon; the spike stays as its comparison with a worker
that opens its own sessions.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from typing import Any

import torch

from elasticd.clock import SYSTEM_CLOCK
from elasticd.recovery.fetch import fetch_shard
from elasticd.recovery.ranges import needed_blocks, parse_boxes
from elasticd.replication.deadline import LinkRates
from elasticd.replication.lanes import Connections
from elasticd.replication.scatter import Scatter
from elasticd.snapshot.reader import parse_header
from elasticd.worker import shards
from elasticd.worker.copier import tensor_views
from elasticd.worker.slot_rows import Landed, SlotFiles, mapping_address
from elasticd.worker.fetched import Fetched, own_unsharded
from elasticd.worker.state import load_into, plan_rows


class Staging:
    """Old rank ``rank``'s staging buffer: a memfd mapping, kept and grown as needed (its
    pages stay touched from one restore to the next, as restore scratch's do)."""

    def __init__(self) -> None:
        self.fd = -1
        self.mm: mmap.mmap | None = None

    def take(self, size: int) -> mmap.mmap:
        if self.mm is None or len(self.mm) < size:
            self.close()
            self.fd = os.memfd_create("elasticd-spike-staging", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size)
        return self.mm

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
            os.close(self.fd)
            self.mm, self.fd = None, -1


def live_ranges(state) -> list[tuple[int, int]]:
    """[start, end) addresses of every CPU local tensor of the state's DTensors."""
    from torch.distributed.tensor import DTensor

    out = []
    for value in state.values():
        if isinstance(value, torch.nn.Module):
            tensors = list(value.parameters())
        else:
            tensors = [v for st in value.state.values() for v in st.values()]
        for t in tensors:
            if isinstance(t, DTensor):
                local = t._local_tensor
                out.append((local.data_ptr(), local.data_ptr() + local.nbytes))
    return out


class WorkerFetch:
    """The spike's restore for new rank ``rank``: its sessions, staging and link rates live
    from restore to restore (as a daemon's do)."""

    def __init__(self, rank: int, job: str, old_world: int, version: tuple[int, int],
                 holders_of, book: dict, secret: bytes) -> None:
        self.rank, self.job, self.old_world, self.version = rank, job, old_world, version
        self.holders_of = holders_of
        self.connections = Connections(f"w{rank}", secret,
                                       lambda n: tuple(book[n]) if n in book else None,
                                       timeout=300.0, scope=job)
        self.rates = LinkRates()
        self.staging: dict[int, Staging] = {}

    def _fetch(self, q: int, into: Any, select) -> Any:
        return fetch_shard(self.job, q, self.version, into, me=f"w{self.rank}",
                           holders=list(self.holders_of(q)), connections=self.connections,
                           own=(), clock=SYSTEM_CLOCK, rates=self.rates, select=select)

    def _header(self, q: int) -> tuple[Any, mmap.mmap]:
        staging = self.staging.setdefault(q, Staging())
        got = {}

        def into(d):
            got["mm"] = staging.take(d.total_bytes)
            return got["mm"]

        self._fetch(q, into, lambda header: [])
        return parse_header(got["mm"], job=self.job, rank=q), got["mm"]

    def restore(self, state) -> dict[str, float]:
        t0 = time.perf_counter()
        base = self.rank % self.old_world
        header, mm = self._header(base)
        meshes = shards.live_meshes(state)
        need = shards.needed_ranks(header.meta, self.old_world, base, meshes)
        pieces = {base: (header, mm)}
        for q in need[1:]:
            pieces[q] = self._header(q)
        fetched = {q: Fetched(tensor_views(m, h.layout), h.meta, "peer", h.layout.total_size,
                               [e.name for e in h.layout.entries], rank=q)
                   for q, (h, m) in pieces.items()}
        for q, f in fetched.items():
            f.slot_file = (mapping_address(pieces[q][1]), self.staging[q].fd,
                           len(pieces[q][1]))
        got = fetched[base]
        got.others = [fetched[q] for q in need[1:]]
        t1 = time.perf_counter()
        # The plan: the product's plan-only pass (the row copies its reshard would make).
        files = [p.slot_file for p in (got, *got.others)]
        copies = plan_rows(state, got.tensors, got.meta, SlotFiles(files), names=got.names,
                           others=[(o.names, o.tensors, o.meta) for o in got.others])
        t2 = time.perf_counter()
        live = live_ranges(state)
        by_mapping = {mapping_address(m): q for q, (_, m) in pieces.items()}
        routes: dict[int, list] = {q: [] for q in pieces}
        for c in copies:
            # A route writes where the plan says: only ever inside a live tensor.
            assert any(a <= c.into and c.into + c.nbytes <= b for a, b in live), c
            dest = (ctypes.c_char * c.nbytes).from_address(c.into)
            routes[by_mapping[c.mapping]].append((c.at, memoryview(dest).cast("B")))
        boxes = parse_boxes(shards.local_boxes(state))
        wire = 0
        for q, (h, m) in pieces.items():
            result = self._fetch(q, Scatter(m, routes[q], header_end=h.layout.data_offset),
                                 lambda header: needed_blocks(header, boxes))
            wire += result.wire_bytes
        t3 = time.perf_counter()
        got = own_unsharded(got)
        load_into(state, got.tensors, got.meta, names=got.names,
                  others=[(o.names, o.tensors, o.meta) for o in got.others],
                  base_views=True, files=Landed(files, copies))
        t4 = time.perf_counter()
        return {"headers_seconds": t1 - t0, "plan_seconds": t2 - t1, "fetch_seconds": t3 - t2,
                "load_seconds": t4 - t3, "wire_bytes": wire,
                "routed_bytes": sum(c.nbytes for c in copies),
                "old_ranks": len(pieces)}

    def close(self) -> None:
        self.connections.close()
        for s in self.staging.values():
            s.close()
