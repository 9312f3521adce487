"""One rank's snapshot as a safetensors file: written straight from shared memory, read back
with every claim checked.

The persistent tier must stay readable by standard tools without elasticd
(``safetensors.torch.load_file``, ``safetensors.safe_open``), so each rank's state is a plain
safetensors file: an 8-byte little-endian header length, a JSON header naming every tensor's
dtype, shape and byte range, then the tensors back to back. ``bfloat16`` stays ``BF16``. The few
dtypes safetensors lacks (complex32, float8 fnuz variants, ...) are stored as ``U8`` bytes and
their true dtype is recorded in elasticd's metadata. That metadata — one JSON string under the
``"elasticd"`` key of ``__metadata__`` — holds the job, (generation, step), rank, world size,
the tensors' order (the flatten meta refers to tensors by index) and the flatten meta itself.

A step's directory is also a checkpoint ``torch.distributed.checkpoint.load`` reads at any
world size with torch's own ``HuggingFaceStorageReader`` (format v2; how to load it:
docs/worker-api.md, "Sharded training (FSDP2)"): a tensor's key is its entry name with ``/``
read as ``.`` (an optimizer's state by the parameter names the worker found in a module of the
same state, as DCP's ``get_state_dict`` keys it), and ``__metadata__`` carries DCP's
``DCP_SHARDING_INFO``: each key's offsets in its global tensor (a DTensor's local shard, from
the snapshot's meta; zeros for a whole tensor). No pickle (DCP's own ``.metadata`` file is one);
elasticd reads the files back itself.

Writing never copies a tensor in Python: each entry's bytes go from the slot's mapping into the
file with one ``write``. The file is hashed with xxh3_64 as it is written; the tier records that
hash, and :func:`read` checks it before trusting a byte. No torch here: the daemon writes these.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import struct
from typing import Any

import xxhash

from elasticd.snapshot.format import (
    DTYPES,
    CorruptSnapshot,
    Entry,
    Layout,
    SnapshotHeader,
    TruncatedSnapshot,
    byte_view,
    dtensor_nodes,
)

#: Our dtype names -> safetensors dtype names, for those standard readers map back exactly.
ST_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
}
_FROM_ST = {v: k for k, v in ST_DTYPES.items()}
METADATA_KEY = "elasticd"
#: 1: tensors keyed by entry name; 2: keyed for torch.distributed.checkpoint (``keys``), with
#: its DCP_SHARDING_INFO.
FILE_VERSION = 2
#: The ``__metadata__`` key under which torch.distributed.checkpoint's HuggingFaceStorageReader
#: reads ``{key: {"saved_offsets": [...]}}`` (torch/distributed/checkpoint/_hf_utils.py).
DCP_SHARDING_KEY = "DCP_SHARDING_INFO"
_LEN = struct.Struct("<Q")
#: safetensors itself refuses larger headers.
MAX_HEADER = 100 << 20


@dataclasses.dataclass(frozen=True)
class PersistedSnapshot:
    """A rank's snapshot read back from disk: the layout of its tensors inside ``buffer``.

    ``layout`` and ``meta`` are what :func:`elasticd.worker.state.load_into` (through
    :func:`~elasticd.worker.copier.read_tensors`) needs, exactly as for a snapshot in RAM.
    """

    job: str
    generation: int
    step: int
    rank: int
    world_size: int
    layout: Layout
    meta: dict[str, Any]
    buffer: Any = dataclasses.field(repr=False)

    def version(self) -> tuple[int, int]:
        return (self.generation, self.step)


def dcp_keys(names: list[str], meta: Any = None) -> list[str]:
    """Each entry's safetensors key: its name with ``/`` read as ``.`` (DCP's fully qualified
    name of the same value), or, where another entry already took that key, the name itself
    (made unique with ``~n``; such clashes need names that hold dots and slashes alike). An
    optimizer's state entry is keyed by its parameter's name where the flatten meta gives it
    (``param_names``, :func:`elasticd.worker.state.flatten`; see the module docstring).
    """
    by_name = _param_names(meta)
    keys: list[str] = []
    used = {"__metadata__"}  # safetensors' own key
    for name in names:
        head, _, leaf = name.rpartition("/")  # "optim/state/3", "exp_avg"
        key = f"{by_name[head]}.{leaf}" if head in by_name else name.replace("/", ".")
        if key in used:
            key, n = name, 1
            while key in used:
                n += 1
                key = f"{name}~{n}"
        used.add(key)
        keys.append(key)
    return keys


def _param_names(meta: Any) -> dict[str, str]:
    """Entry name -> DCP key for the optimizer state entries ``meta["param_names"]`` names.

    The meta is the job's (its worker wrote it): anything but a name list per optimizer key
    is ignored, and the entries then keep their index keys.
    """
    named = meta.get("param_names") if isinstance(meta, dict) else None
    if not isinstance(named, dict):
        return {}
    return {f"{obj}/state/{i}": f"{obj}.state.{param}" for obj, params in named.items()
            if isinstance(obj, str) and isinstance(params, list)
            and all(isinstance(p, str) and p for p in params) for i, param in enumerate(params)}


def encode_header(header: SnapshotHeader) -> bytes:
    """The safetensors preamble (length + JSON header, space-padded to 8 bytes) for a snapshot."""
    entries = header.layout.entries
    keys = dcp_keys([e.name for e in entries], header.meta)
    offsets = {node["i"]: node["offsets"] for node in dtensor_nodes(header.meta)
               if isinstance(node.get("i"), int)}
    tensors: dict[str, Any] = {}
    raw: dict[str, list[Any]] = {}
    sharding: dict[str, dict[str, list[int]]] = {}
    pos = 0
    for i, (e, key) in enumerate(zip(entries, keys)):
        st, shape = ST_DTYPES.get(e.dtype), list(e.shape)
        if st is None:  # no exact safetensors dtype: keep the bytes, record the truth
            raw[e.name] = [e.dtype, shape]
            st, shape = "U8", [e.nbytes]
        tensors[key] = {"dtype": st, "shape": shape, "data_offsets": [pos, pos + e.nbytes]}
        # DCP's reader needs every key here once any is (a whole tensor starts at zeros).
        # The meta is the worker's: offsets that are not one count per dimension are not
        # written for DCP (the tensor then reads as whole).
        at = offsets.get(i)
        valid = (isinstance(at, list) and len(at) == len(shape) and e.name not in raw
                 and all(type(x) is int and x >= 0 for x in at))
        sharding[key] = {"saved_offsets": list(at) if valid else [0] * len(shape)}
        pos += e.nbytes
    info = {"format": FILE_VERSION, "job": header.job, "generation": header.generation,
            "step": header.step, "rank": header.rank, "world_size": header.world_size,
            "names": [e.name for e in entries], "keys": keys, "raw": raw, "meta": header.meta}
    tensors["__metadata__"] = {
        METADATA_KEY: json.dumps(info, separators=(",", ":"), allow_nan=False),
        DCP_SHARDING_KEY: json.dumps(sharding, separators=(",", ":"))}
    body = json.dumps(tensors, separators=(",", ":"), allow_nan=False).encode()
    body += b" " * (-len(body) % 8)
    return _LEN.pack(len(body)) + body


def write(path: str, header: SnapshotHeader, buffer: Any, mode: int = 0o600) -> tuple[int, int]:
    """Writes the snapshot in ``buffer`` (laid out as ``header``) to a new file at ``path``.

    The file is fsynced before this returns; making it visible (rename) is the caller's job.

    Returns:
        (bytes written, xxh3_64 of the whole file).

    Raises:
        OSError: the file exists or cannot be written (a partial file is removed).
    """
    view = byte_view(buffer)
    hasher = xxhash.xxh3_64()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    total = 0
    try:
        with os.fdopen(fd, "wb", buffering=0, closefd=False) as f:
            def put(chunk: Any) -> None:
                nonlocal total
                hasher.update(chunk)
                done = 0
                while done < len(chunk):  # raw writes may be short
                    done += f.write(chunk[done:])
                total += done

            put(encode_header(header))
            for e in header.layout.entries:
                if e.nbytes:
                    put(view[e.offset : e.offset + e.nbytes])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    os.close(fd)
    return total, hasher.intdigest()


def read(path: str, *, expect_bytes: int | None = None, expect_xxh3: int | None = None
         ) -> PersistedSnapshot:
    """Reads a rank file, checks its size and hash (when given) and parses it.

    Raises:
        TruncatedSnapshot, CorruptSnapshot: the file is shorter, altered or not ours.
        OSError: the file cannot be read (e.g. pruned meanwhile).
    """
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if expect_bytes is not None and size != expect_bytes:
            cls = TruncatedSnapshot if size < expect_bytes else CorruptSnapshot
            raise cls(f"{path}: {size} bytes, the manifest says {expect_bytes}")
        buf, got = bytearray(size), 0
        while got < size:
            n = f.readinto(memoryview(buf)[got:])
            if not n:
                raise TruncatedSnapshot(f"{path}: file ended after {got} of {size} bytes")
            got += n
    if expect_xxh3 is not None:
        digest = xxhash.xxh3_64_intdigest(buf)
        if digest != expect_xxh3:
            raise CorruptSnapshot(f"{path}: xxh3 {digest:016x} != {expect_xxh3:016x} recorded "
                                  "in the manifest (the file was altered)")
    return parse(buf, where=path)


def _fail(where: str, what: str) -> CorruptSnapshot:
    return CorruptSnapshot(f"{where}: {what}")


def parse(buf: Any, where: str = "safetensors file") -> PersistedSnapshot:
    """Parses an elasticd safetensors file held in ``buf`` (no copy of the tensor bytes).

    Raises:
        TruncatedSnapshot, CorruptSnapshot: anything that does not add up.
    """
    view = byte_view(buf)
    if len(view) < _LEN.size:
        raise TruncatedSnapshot(f"{where}: {len(view)} bytes, no safetensors header")
    (hlen,) = _LEN.unpack_from(view)
    if hlen > MAX_HEADER:
        raise _fail(where, f"header length {hlen} exceeds {MAX_HEADER}")
    start = _LEN.size + hlen
    if len(view) < start:
        raise TruncatedSnapshot(f"{where}: header of {hlen} bytes, file ends before it")
    try:
        header = json.loads(bytes(view[_LEN.size : start]))
        info = json.loads(header["__metadata__"][METADATA_KEY])
        names, raw, meta = info["names"], info["raw"], info["meta"]
        keys = info.get("keys", names)  # format 1: keyed by entry name
        ints = {k: info[k] for k in ("format", "generation", "step", "rank", "world_size")}
        job = info["job"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise _fail(where, f"not an elasticd safetensors header ({exc!r:.80})") from exc
    if any(type(v) is not int or v < 0 for v in ints.values()) or not isinstance(job, str):
        raise _fail(where, f"bad elasticd metadata {ints}")
    if ints["format"] > FILE_VERSION:
        raise _fail(where, f"written in persisted format v{ints['format']}, this elasticd "
                    f"reads up to v{FILE_VERSION}")
    if ints["rank"] >= ints["world_size"] or not isinstance(meta, dict) \
            or not isinstance(raw, dict) or not isinstance(names, list) \
            or not isinstance(keys, list) or len(keys) != len(names) \
            or not all(isinstance(k, str) for k in keys):
        raise _fail(where, "inconsistent elasticd metadata")
    if set(keys) != set(header) - {"__metadata__"} or len(set(keys)) != len(keys) \
            or len(set(names)) != len(names):
        raise _fail(where, "the tensor list in the metadata does not match the header")
    entries, end = [], 0
    for name, key in zip(names, keys):
        entries.append(_entry(header[key], raw.get(name), name, start, where))
    for e in sorted(entries, key=lambda e: (e.offset, e.nbytes)):
        if e.offset != start + end:
            raise _fail(where, f"tensor {e.name!r} does not follow its neighbour")
        end += e.nbytes
    if start + end != len(view):
        cls = TruncatedSnapshot if start + end > len(view) else CorruptSnapshot
        raise cls(f"{where}: tensors need {start + end} bytes, the file has {len(view)}")
    lay = Layout(tuple(entries), start, start + end)
    return PersistedSnapshot(job, ints["generation"], ints["step"], ints["rank"],
                             ints["world_size"], lay, meta, buf)


def _entry(spec: Any, raw: Any, name: str, start: int, where: str) -> Entry:
    try:
        st, shape, (a, b) = spec["dtype"], spec["shape"], spec["data_offsets"]
    except (KeyError, TypeError, ValueError) as exc:
        raise _fail(where, f"tensor {name!r}: bad header entry") from exc
    if raw is not None:  # stored as bytes; the metadata holds the real dtype and shape
        if st != "U8" or not isinstance(raw, list) or len(raw) != 2:
            raise _fail(where, f"tensor {name!r}: bad raw-dtype record {raw!r:.60}")
        dtype, shape = raw
    else:
        dtype = _FROM_ST.get(st)
    if dtype not in DTYPES or not isinstance(shape, list) \
            or any(type(d) is not int or d < 0 for d in shape):
        raise _fail(where, f"tensor {name!r}: unknown dtype {st!r} or bad shape {shape!r:.60}")
    if any(type(x) is not int for x in (a, b)) or not 0 <= a <= b:
        raise _fail(where, f"tensor {name!r}: bad data offsets {[a, b]}")
    nbytes = math.prod(shape) * DTYPES[dtype][0]
    if b - a != nbytes:
        raise _fail(where, f"tensor {name!r}: {b - a} bytes do not hold {dtype}{tuple(shape)}")
    return Entry(name, dtype, tuple(shape), start + a, nbytes)
