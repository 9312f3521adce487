"""Sharded tensors (DTensor: FSDP2's parameters and optimizer state) in snapshots, and their
restore at any world size.

Saving gathers nothing: each rank stores its DTensors' local tensors (``_local_tensor``, never
``full_tensor()``) and, in the snapshot's JSON meta, what a later world needs to place them: the
global shape, the placements, the device mesh's shape and dimension names, and the shard's
offsets. The chunk model is DCP's (``torch.distributed.checkpoint``'s ``ChunkStorageMetadata``):
a shard is the box ``[offsets, offsets + local shape)`` of the global tensor, computed here as
DCP computes it (``compute_local_shape_and_global_offset``); FSDP2 shards dim 0 unevenly, so the
last ranks may hold fewer rows, or none.

Restoring is one code path for every world size (:class:`Resharder`): the new rank computes the
box it must hold on the live device mesh, the old ranks whose boxes intersect it
(:func:`needed_ranks`, from the saved layout alone, so only those snapshots are fetched), and
copies each intersection out of the old shards into its new local tensor. At the same world
size the one intersecting box is its own, and the saved tensor is used as is. Placements other
than ``Shard(d)`` and ``Replicate()`` (``Partial``, the strided shards of FSDP2 over tensor
parallelism) are refused at the first save with the reason (:class:`UnsupportedValue`). Worker
side: imports torch.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Iterator, Mapping, Sequence

import torch

from elasticd.errors import CheckpointError
from elasticd.snapshot.format import dtensor_nodes
from elasticd.worker.slot_rows import RowCopy, SlotFiles

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


class ShardError(CheckpointError):
    """Base: the sharded part of a snapshot cannot be saved or placed into this state."""


class UnsupportedShard(ShardError, TypeError):
    """A DTensor whose placement elasticd cannot snapshot (the message says which and why)."""


class ShardMismatch(ShardError):
    """The saved shards do not fit the live state (no matching mesh, rows not held)."""


def dtensor_class() -> type | None:
    """DTensor, if the script imported it (only then can a state hold one; importing it
    costs time a script without sharding should not pay)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _placement_name(path: str, placement: Any) -> str:
    from torch.distributed.tensor import Replicate, Shard

    if type(placement) is Shard:  # not _StridedShard (FSDP2 over TP): its rows interleave
        return f"S{placement.dim}"
    if type(placement) is Replicate:
        return "R"
    raise UnsupportedShard(
        f"{path}: a DTensor placed {placement!r} cannot be snapshotted (elasticd stores "
        "Shard(d) and Replicate() placements; Partial values need a reduction first)")


def _placements(names: Sequence[str]) -> tuple[Any, ...]:
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for name in names:
        if name == "R":
            out.append(Replicate())
        elif isinstance(name, str) and name[:1] == "S" and name[1:].isdigit():
            out.append(Shard(int(name[1:])))
        else:
            raise ShardMismatch(f"unknown placement {name!r} in the snapshot")
    return tuple(out)


_box_cache: dict[tuple[Any, ...], Box] = {}


def local_box(shape: Sequence[int], mesh: Any, placements: Sequence[Any]) -> Box:
    """(offsets, local shape) of this rank's chunk of a tensor of global ``shape`` (DCP's)."""
    key = (tuple(shape), mesh, tuple(placements))
    box = _box_cache.get(key)
    if box is None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local, offsets = compute_local_shape_and_global_offset(torch.Size(shape), mesh,
                                                               placements)
        box = _box_cache[key] = (tuple(int(o) for o in offsets), tuple(int(s) for s in local))
        if len(_box_cache) > 4096:  # meshes of finished process groups
            _box_cache.clear()
    return box


_node_cache: dict[Any, tuple[dict[str, Any], tuple[int, ...]]] = {}


def forget_layouts() -> None:
    """Empties the layout caches: their keys hold device meshes, and so the meshes' process
    groups (:mod:`elasticd.worker.dtensor_caches` says why, and calls this at each leave)."""
    _box_cache.clear()
    _node_cache.clear()


def describe(path: str, dtensor: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """This rank's local tensor of ``dtensor`` (no copy) and the meta a later world needs
    (shared between calls for the same layout: do not modify it).

    Raises:
        UnsupportedShard: a placement elasticd does not store, or a local tensor that is not
            the chunk its placement says (padded).
    """
    local = dtensor._local_tensor
    # The spec (mesh, placements, global shape, stride, dtype) caches its hash, and a
    # parameter's or optimizer state's DTensor keeps its spec object from step to step, so
    # the lookup is an identity check (hashing mesh and placements each time cost ~1 ms per
    # flatten of 288 DTensors).
    key = dtensor._spec
    hit = _node_cache.get(key)
    if hit is None:  # flatten runs every step: each layout is worked out once
        mesh, placements = key.mesh, key.placements
        names = [_placement_name(path, p) for p in placements]
        offsets, shape = local_box(dtensor.shape, mesh, placements)
        node = {"shape": list(dtensor.shape), "offsets": list(offsets), "placements": names,
                "mesh": list(mesh.shape), "dims": list(mesh.mesh_dim_names or ())}
        if len(_node_cache) > 4096:
            _node_cache.clear()
        hit = _node_cache[key] = (node, shape)
    if tuple(local.shape) != hit[1]:
        raise UnsupportedShard(f"{path}: the DTensor's local tensor is {tuple(local.shape)}, "
                               f"not the {hit[1]} chunk its placements "
                               f"{hit[0]['placements']} give")
    return local, hit[0]


def live_meshes(state: Mapping[str, Any]) -> list[Any]:
    """The distinct device meshes of the DTensors in ``state``'s modules and optimizers."""
    cls = dtensor_class()
    if cls is None:
        return []
    found: list[Any] = []
    for value in state.values():
        if isinstance(value, torch.nn.Module):
            tensors: Any = [*value.parameters(), *value.buffers()]
        elif isinstance(value, torch.optim.Optimizer):
            tensors = [p for g in value.param_groups for p in g["params"]]
        else:
            continue
        for t in tensors:
            if isinstance(t, cls) and t.device_mesh not in found:
                found.append(t.device_mesh)
    return found


def mesh_for(node: Mapping[str, Any], meshes: Sequence[Any]) -> Any:
    """The live mesh a saved DTensor goes onto: the one of the same dimensions (names).

    Raises:
        ShardMismatch: none, or several that cannot be told apart.
    """
    dims = tuple(node.get("dims") or ())
    ndim = len(node.get("mesh") or ())
    fit = [m for m in meshes if m.ndim == ndim and tuple(m.mesh_dim_names or ()) == dims]
    if len(fit) != 1:
        raise ShardMismatch(
            f"the snapshot holds DTensors on a {ndim}-dimensional device mesh {list(dims)}, "
            f"and the state has {len(fit)} such meshes: build (fully_shard) the model and "
            "optimizer before restoring")
    return fit[0]


def _chunk_1d(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of ``torch.chunk``'s part ``index`` of ``size`` (what Shard uses)."""
    full = -(-size // parts) if parts else 0
    start = min(index * full, size)
    return start, max(0, min(size, start + full) - start)


def old_box(node: Mapping[str, Any], rank: int) -> Box | None:
    """The box old rank ``rank`` held, from the saved layout (a 1-dim mesh), or None when it
    cannot be computed without that rank's own meta (a mesh of several dimensions)."""
    mesh = node["mesh"]
    if len(mesh) != 1:
        return None
    offsets, shape = [0] * len(node["shape"]), list(node["shape"])
    for name in node["placements"]:
        if name != "R":
            dim = int(name[1:])
            offsets[dim], shape[dim] = _chunk_1d(shape[dim], mesh[0], rank)
    return tuple(offsets), tuple(shape)


def _overlap(a: Box, b: Box) -> Box | None:
    offsets, shape = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        shape.append(hi - lo)
    return tuple(offsets), tuple(shape)


def local_boxes(state: Mapping[str, Any]) -> list[list[Any]]:
    """What ``ckpt_fetch``'s ``need`` carries (:mod:`elasticd.recovery.ranges`): this rank's
    box for each (global shape, placements) of the live state's DTensor parameters, so that
    the daemon fetches only the rows of an old snapshot that overlap it. A key two parameters
    give different boxes is left out (its entries are then fetched whole), and so is a
    placement elasticd does not store."""
    from torch.distributed.tensor import DTensor

    boxes: dict[tuple[Any, ...], list[list[int]]] = {}
    clash = set()
    for value in state.values():
        if not isinstance(value, torch.nn.Module):
            continue
        for name, param in value.named_parameters():
            if not isinstance(param, DTensor):
                continue
            try:
                local, node = describe(name, param)
            except UnsupportedShard:
                continue
            key = (tuple(node["shape"]), tuple(node["placements"]))
            box = [list(node["offsets"]), list(local.shape)]
            if boxes.setdefault(key, box) != box:
                clash.add(key)
    return [[list(k[0]), list(k[1]), *b] for k, b in boxes.items() if k not in clash]


def needed_ranks(meta: Any, old_world: int, base: int, meshes: Sequence[Any]) -> list[int]:
    """The old ranks whose snapshots the new local shards need (``base`` first: its snapshot
    also holds this rank's unsharded state). A mesh of several dimensions: every old rank.

    Raises:
        ShardMismatch: no live mesh fits a saved DTensor.
    """
    need = {base}
    for node in dtensor_nodes(meta):
        mesh = mesh_for(node, meshes)
        target = local_box(node["shape"], mesh, _placements(node["placements"]))
        if not math.prod(target[1]):
            continue
        boxes = {}
        for q in [base, *range(old_world)]:
            box = old_box(node, q)
            if box is None:
                return list(dict.fromkeys([base, *range(old_world)]))
            boxes.setdefault(box, q)  # a replicated box: the first holder, base preferred
        need.update(q for box, q in boxes.items() if _overlap(box, target) is not None)
    return [base, *sorted(need - {base})]


class Resharder:
    """Builds each saved DTensor's new local shard on the live mesh from the old shards.

    Args:
        state: the live state (its modules' and optimizers' meshes).
        pieces: (tensor names, tensors, meta) of each fetched old snapshot, the base one
            (whose meta tree is being loaded) first.
        base_owned: the base piece's tensors are this rank's own copies, which a shard that
            needs nothing else may become as they are; False when they are views of a slot
            (a reshard reads every piece in place), which are copied.
        files: the slot files the pieces read in place are mapped from: their rows are
            copied from there with ``preadv``, not through the mappings (:mod:`.slot_rows`).
    """

    def __init__(self, state: Mapping[str, Any],
                 pieces: Sequence[tuple[Sequence[str], Sequence[torch.Tensor], Any]],
                 base_owned: bool = True, files: SlotFiles | None = None) -> None:
        self.base_owned = base_owned
        self.files = files
        self.meshes = live_meshes(state)
        self.base_names, self.base_tensors = pieces[0][:2]
        # name -> [(box, tensor)] over every old snapshot after the base one
        self.others: dict[str, list[tuple[Box, torch.Tensor]]] = {}
        for names, tensors, meta in pieces[1:]:
            for node in dtensor_nodes(meta):
                t = tensors[node["i"]]
                self.others.setdefault(names[node["i"]], []).append(
                    ((tuple(node["offsets"]), tuple(t.shape)), t))

    def __call__(self, node: Mapping[str, Any], live: Any = None) -> Any:
        """The DTensor ``node`` (a saved sharded entry) becomes on this rank.

        Args:
            live: the state's own DTensor at the same place (the parameter, the optimizer's
                moment), when it has one: if it is the very tensor this rank must hold (the
                same global shape, dtype and placements on the mesh, in host memory), the new
                shard is assembled straight into its local tensor and it is returned, so the
                rows go from the fetched snapshots to where the state reads them in one copy,
                into memory already touched (the object's ``load_state_dict`` then copies it
                onto itself, which torch skips). Otherwise a new local tensor is made.
        """
        from torch.distributed.tensor import DTensor

        name, shape, mine, placements, mesh, target, chunks = self._chunks(node)
        into = _destination(live, shape, mesh, placements, target, mine)
        if into is not None:
            self._assemble(name, target, chunks, mine.dtype, into=into, files=self.files)
            return live
        local = self._assemble(name, target, chunks, mine.dtype, self.base_owned,
                               files=self.files)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, mesh, placements, run_check=False,
                                  shape=torch.Size(shape), stride=stride)

    def plan(self, node: Mapping[str, Any], live: Any = None) -> list[RowCopy]:
        """The row copies :meth:`__call__` would make for ``node`` out of the slot files
        straight into ``live``'s own local tensor (:meth:`SlotFiles.locate
        <elasticd.worker.slot_rows.SlotFiles.locate>`), making none: empty when the new shard
        would not be assembled in place (a GPU destination, another dtype) or no file holds
        its rows. A direct fetch lands those rows there itself (:mod:`.direct`)."""
        _, shape, mine, placements, mesh, target, chunks = self._chunks(node)
        into = _destination(live, shape, mesh, placements, target, mine)
        if into is None or self.files is None:
            return []
        out = []
        for t, dst, src in _parts(target, chunks, mine.dtype):
            copy = self.files.locate(into, dst, t, src)
            if copy is not None:
                out.append(copy)
        return out

    def _chunks(self, node: Mapping[str, Any]) -> tuple[Any, ...]:
        """``node``'s name, global shape, saved local tensor, placements, live mesh, this
        rank's new box, and the saved chunks that may cover it (the base piece's first)."""
        try:
            i, shape = node["i"], [int(s) for s in node["shape"]]
            mine = self.base_tensors[i]
            saved = ((tuple(int(o) for o in node["offsets"]), tuple(mine.shape)), mine)
            placements = _placements(node["placements"])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ShardMismatch(f"malformed dtensor node: {exc}") from exc
        mesh = mesh_for(node, self.meshes)
        target = local_box(shape, mesh, placements)
        name = self.base_names[i] if self.base_names else str(i)
        return (name, shape, mine, placements, mesh, target,
                [saved, *self.others.get(name, [])])

    @staticmethod
    def _assemble(name: str, target: Box, chunks: list[tuple[Box, torch.Tensor]],
                  dtype: torch.dtype, base_owned: bool = True,
                  into: torch.Tensor | None = None,
                  files: SlotFiles | None = None) -> torch.Tensor:
        for box, t in chunks:
            if box == target and into is None:  # the same world: the saved copy as it is
                # Only the base piece may be this rank's own copy; the others are views of a
                # slot that goes back to the daemon after the load.
                return t if base_owned and t is chunks[0][1] else t.clone()
        out = torch.empty(target[1], dtype=dtype) if into is None else into
        covered = 0
        for t, dst, src in _parts(target, chunks, dtype):
            if files is None or not files.read(out, dst, t, src):
                out[dst] = t[src]
            covered += math.prod(d.stop - d.start for d in dst)
        if covered != math.prod(target[1]):
            raise ShardMismatch(f"{name}: the shards fetched hold {covered} of the "
                                f"{math.prod(target[1])} elements this rank needs")
        return out


def _parts(target: Box, chunks: list[tuple[Box, torch.Tensor]], dtype: torch.dtype
           ) -> Iterator[tuple[torch.Tensor, tuple[slice, ...], tuple[slice, ...]]]:
    """Each saved chunk's overlap with ``target``: (the chunk, where in the new shard, where
    in the chunk), each distinct box once (a replicated one is held by several old ranks)."""
    seen = set()
    for box, t in chunks:
        if box in seen or t.dtype != dtype:
            continue
        seen.add(box)
        part = _overlap(box, target)
        if part is None:
            continue
        yield (t, tuple(slice(o - to, o - to + n) for o, n, to in zip(*part, target[0])),
               tuple(slice(o - bo, o - bo + n) for o, n, bo in zip(*part, box[0])))


def _destination(live: Any, shape: Sequence[int], mesh: Any, placements: Sequence[Any],
                 target: Box, saved: torch.Tensor) -> torch.Tensor | None:
    """``live``'s local tensor when a new shard may be assembled straight into it: a DTensor
    of the same global shape and dtype, on ``mesh`` with ``placements``, whose local tensor is
    the ``target`` box, contiguous, in host memory (a GPU destination keeps its own copy path:
    the new shard is made on the host and loaded by the object); else None."""
    dtensor = dtensor_class()
    if dtensor is None or not isinstance(live, dtensor):
        return None
    local = live._local_tensor
    if (tuple(live.shape) != tuple(shape) or live.dtype != saved.dtype
            or live.device_mesh != mesh or tuple(live.placements) != tuple(placements)
            or tuple(local.shape) != tuple(target[1]) or local.device.type != "cpu"
            or not local.is_contiguous() or local.requires_grad):
        return None
    return local
