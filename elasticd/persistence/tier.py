"""The persistent tier's layout on disk, and the rules that keep it consistent across nodes.

::

    <root>/<job>/step-<generation>-<step>/rank-<r>.safetensors   one per rank, by its owner
                                         /rank-<r>.json          marker: size + xxh3 of the file
                                         /manifest.json          written last: the step is complete

Every file appears atomically (written to a unique temporary name, fsynced, renamed, the
directory fsynced), so a reader never sees half a file and a crash leaves only temporaries; a
new job or step directory is fsynced into its parent, so a step is not lost with its directory
entry after a power cut.

The daemon may run as root and write for a job running as another user, so it never writes
where that user could: job and step directories are the daemon's own (mode 0755: step names are
not secret), created and opened relative to their parent's descriptor with ``O_NOFOLLOW`` and
refused (:class:`TierError`) when they are anyone else's; files are created there and only then
given to the job's user (0600, ``lchown`` relative to the directory descriptor), so that user —
and no other job's — can read them back at restore. A manifest whose fields have the wrong type
is ignored like an unreadable one (the restore falls back), never an exception.
Several nodes write the ranks of one step into the same directory on a shared filesystem; each
writes only its own ranks' files and markers. Whoever then sees every rank's marker writes the
manifest — through ``link()`` of a complete temporary file, which fails with EEXIST for all but
one writer, so the manifest is created exactly once and never seen half-written. If two nodes
each miss the other's marker (a stale directory listing), whoever lists the step next (a later
flush, a restore's listing) completes it. A step is complete exactly when ``manifest.json``
exists; only complete steps are ever restored, so no crash between files can yield a mix.

Pruning keeps the N newest complete steps, and removes incomplete ones older than the newest
complete step (an abandoned flush); a step is renamed away before it is deleted, so a reader
sees it whole or not at all. No torch here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import stat
import uuid
from typing import Any, Iterator

from elasticd.snapshot.format import JOB_RE, CorruptSnapshot, SnapshotHeader
from elasticd.errors import CheckpointError
from elasticd.persistence import safetensors_file
from elasticd.persistence.safetensors_file import PersistedSnapshot

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "elasticd-checkpoint"
MANIFEST_VERSION = 1
_STEP_RE = re.compile(r"step-(\d+)-(\d+)")
_MARKER_RE = re.compile(r"rank-(\d+)\.json")
_XXH3_RE = re.compile(r"[0-9a-f]{16}")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_MODE = 0o755


class TierError(CheckpointError):
    """The persistent tier cannot be used as asked (bad job name, unreadable step)."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A complete step: its version, world size and every rank's file record."""

    job: str
    generation: int
    step: int
    world_size: int
    ranks: dict[int, dict[str, Any]]

    def version(self) -> tuple[int, int]:
        return (self.generation, self.step)


def _step_name(version: tuple[int, int]) -> str:
    return f"step-{int(version[0])}-{int(version[1])}"


def _tmp_name(name: str) -> str:
    return f".{name}.{uuid.uuid4().hex[:12]}.tmp"


def _in(dir_fd: int, name: str) -> str:
    """A path to ``name`` inside the directory open as ``dir_fd`` (through the descriptor,
    never re-walking the directory's own path)."""
    return f"/proc/self/fd/{dir_fd}/{name}"


def _own_dir(parent_fd: int, name: str, where: str) -> int:
    """Opens the daemon's own directory ``name`` in ``parent_fd``, creating it (and fsyncing
    it into the parent) when missing.

    Raises:
        TierError: it is a symlink, or not the daemon's alone (see the module docstring).
    """
    created = False
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, _DIR_MODE, dir_fd=parent_fd)
        created = True
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise TierError(f"{where} is not a directory (a symlink?); refusing to write "
                            "there: remove it") from exc
        raise
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise TierError(f"{where} belongs to uid {st.st_uid} with mode "
                        f"{stat.S_IMODE(st.st_mode):#o}, not to the daemon (uid {os.geteuid()}) "
                        "alone: refusing to write there (its owner could redirect the write); "
                        "chown -R it to the daemon's user or move it away")
    if created:
        os.fsync(parent_fd)
    return fd


def _give(dir_fd: int, name: str, uid: int | None) -> None:
    """Gives ``name`` to the job's user (see the module docstring), never through a symlink."""
    if uid is not None and os.geteuid() == 0 and uid != 0:
        os.chown(name, uid, -1, dir_fd=dir_fd, follow_symlinks=False)


def _owner(dir_fd: int, markers: dict[int, Any]) -> int | None:
    """The one user every marker of a step was given to, if any.

    A step the listing completes (no writer saw every marker) is finished by whoever lists it,
    without a job to ask for the user: the daemon, as root, would leave a manifest (mode 0600)
    the job's workers cannot read, and the step would stay invisible to their restores.
    """
    try:
        owners = {os.stat(f"rank-{r}.json", dir_fd=dir_fd, follow_symlinks=False).st_uid
                  for r in markers}
    except FileNotFoundError:  # pruned meanwhile: the manifest's own checks decide
        return None
    return owners.pop() if len(owners) == 1 else None


def _valid_record(record: Any, rank: int) -> bool:
    """Whether a marker or manifest rank record has the fields a read needs, typed."""
    return (isinstance(record, dict) and type(record.get("rank")) is int
            and record["rank"] == rank and type(record.get("world_size")) is int
            and type(record.get("bytes")) is int and record["bytes"] >= 0
            and isinstance(record.get("xxh3_64"), str) and bool(_XXH3_RE.fullmatch(
                record["xxh3_64"])) and isinstance(record.get("file"), str))


def _write_json(path: str, obj: Any) -> None:
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


class Tier:
    """Reads and writes steps under ``root``.

    Args:
        root: the directory (a shared filesystem in production); created when missing.
        node_id: recorded in markers, for operators.
    """

    def __init__(self, root: str, node_id: str = "") -> None:
        self.root, self.node_id = root, node_id
        os.makedirs(root, mode=0o755, exist_ok=True)

    def job_dir(self, job: str) -> str:
        if not isinstance(job, str) or not JOB_RE.fullmatch(job):
            raise TierError(f"job name {job!r} must match {JOB_RE.pattern}")
        return os.path.join(self.root, job)

    def step_dir(self, job: str, version: tuple[int, int]) -> str:
        return os.path.join(self.job_dir(job), _step_name(version))

    @contextlib.contextmanager
    def _writable_step(self, job: str, version: tuple[int, int]) -> Iterator[int]:
        """A descriptor of the step's directory, created when missing, verified the daemon's
        own along with the job's (see :func:`_own_dir`)."""
        self.job_dir(job)  # validates the name
        root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            job_fd = _own_dir(root, job, self.job_dir(job))
        finally:
            os.close(root)
        try:
            step_fd = _own_dir(job_fd, _step_name(version), self.step_dir(job, version))
        finally:
            os.close(job_fd)
        try:
            yield step_fd
        finally:
            os.close(step_fd)

    # -- writing --------------------------------------------------------------------------

    def write_rank(self, header: SnapshotHeader, buffer: Any, uid: int | None = None) -> dict:
        """Writes one rank's snapshot and its marker; returns the marker's record."""
        with self._writable_step(header.job, header.version()) as fd:
            name = f"rank-{header.rank}.safetensors"
            tmp = _tmp_name(name)
            nbytes, digest = safetensors_file.write(_in(fd, tmp), header, buffer)
            _give(fd, tmp, uid)
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            record = {"rank": header.rank, "file": name, "bytes": nbytes,
                      "xxh3_64": f"{digest:016x}", "world_size": header.world_size,
                      "generation": header.generation, "step": header.step,
                      "node": self.node_id}
            tmp = _tmp_name(f"rank-{header.rank}.json")
            _write_json(_in(fd, tmp), record)
            _give(fd, tmp, uid)
            # The marker goes after the data file: a marker always names a complete file.
            os.rename(tmp, f"rank-{header.rank}.json", src_dir_fd=fd, dst_dir_fd=fd)
            os.fsync(fd)
        return record

    def try_finish(self, job: str, version: tuple[int, int], uid: int | None = None) -> bool:
        """Writes the step's manifest if every rank's marker is there and nobody has yet; True
        if this call created it."""
        if not os.path.isdir(self.step_dir(job, version)):
            return False
        with self._writable_step(job, version) as fd:
            return self._finish(fd, job, version, uid)

    def _finish(self, fd: int, job: str, version: tuple[int, int], uid: int | None) -> bool:
        markers = self._markers(fd, self.step_dir(job, version))
        world = {m["world_size"] for m in markers.values()}  # none: no marker yet
        if len(world) != 1 or set(markers) != set(range(world.pop())):
            return False
        if uid is None:
            uid = _owner(fd, markers)
        manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "job": job,
                    "generation": int(version[0]), "step": int(version[1]),
                    "world_size": len(markers),
                    "ranks": [markers[r] for r in sorted(markers)]}
        tmp = _tmp_name(MANIFEST)
        _write_json(_in(fd, tmp), manifest)
        _give(fd, tmp, uid)
        try:
            os.link(tmp, MANIFEST, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp, dir_fd=fd)
        os.fsync(fd)
        return True

    def _markers(self, fd: int, directory: str) -> dict[int, dict[str, Any]]:
        out = {}
        for name in os.listdir(fd):
            match = _MARKER_RE.fullmatch(name)
            if not match:
                continue
            try:
                marker = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                with open(marker, "rb") as f:
                    record = json.loads(f.read())
            except (OSError, ValueError) as exc:
                log.warning("persistent tier: unreadable marker %s/%s: %s", directory, name, exc)
                continue
            if _valid_record(record, int(match.group(1))):
                out[int(match.group(1))] = record
            else:
                log.warning("persistent tier: ignoring malformed marker %s/%s", directory, name)
        return out

    # -- reading --------------------------------------------------------------------------

    def _versions(self, job: str) -> list[tuple[int, int]]:
        try:
            names = os.listdir(self.job_dir(job))
        except FileNotFoundError:
            return []
        return sorted(((int(m.group(1)), int(m.group(2))) for n in names
                       if (m := _STEP_RE.fullmatch(n))), reverse=True)

    def manifest(self, job: str, version: tuple[int, int]) -> Manifest | None:
        """The step's manifest, or None when the step is not complete (or unreadable)."""
        path = os.path.join(self.step_dir(job, version), MANIFEST)
        try:
            with open(path, "rb") as f:
                raw = json.loads(f.read())
            ranks = {int(r["rank"]): r for r in raw["ranks"]}
            m = Manifest(raw["job"], int(raw["generation"]), int(raw["step"]),
                         int(raw["world_size"]), ranks)
            bad = [r for r, record in ranks.items() if not _valid_record(record, r)]
            if bad:
                raise ValueError(f"rank record(s) {bad} lack an integer bytes, a 16-digit hex "
                                 "xxh3_64 or a file name")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("persistent tier: ignoring unreadable manifest %s: %s", path, exc)
            return None
        if raw.get("format") != MANIFEST_FORMAT or m.version() != tuple(version) \
                or set(ranks) != set(range(m.world_size)):
            log.warning("persistent tier: ignoring inconsistent manifest %s", path)
            return None
        return m

    def complete_steps(self, job: str, repair: bool = True) -> list[Manifest]:
        """Every complete step of ``job``, newest first.

        Args:
            repair: complete a step every rank's marker is in (see the module docstring).
        """
        out = []
        for version in self._versions(job):
            m = self.manifest(job, version)
            if m is None and repair:
                try:
                    if self.try_finish(job, version):
                        m = self.manifest(job, version)
                except (OSError, TierError) as exc:  # e.g. a worker, which may not write here
                    log.debug("persistent tier: cannot complete %s step %s here: %s", job,
                              version, exc)
            if m is not None:
                out.append(m)
        return out

    def read(self, job: str, version: tuple[int, int], rank: int) -> PersistedSnapshot:
        """Reads and verifies one rank of a complete step.

        Raises:
            TierError: the step is not complete or has no such rank.
            SnapshotError: the file is truncated or altered (hash, size, contents).
            OSError: the file vanished (pruned meanwhile) or cannot be read.
        """
        m = self.manifest(job, version)
        if m is None or rank not in m.ranks:
            raise TierError(f"{job} step {version}: no complete persisted copy of rank {rank}")
        record = m.ranks[rank]
        path = os.path.join(self.step_dir(job, version), os.path.basename(record["file"]))
        snap = safetensors_file.read(path, expect_bytes=int(record["bytes"]),
                                     expect_xxh3=int(record["xxh3_64"], 16))
        if (snap.job, snap.version(), snap.rank, snap.world_size) != \
                (job, tuple(version), rank, m.world_size):
            raise CorruptSnapshot(f"{path}: holds {snap.job} rank {snap.rank} step "
                                  f"{snap.version()}, not what the manifest lists")
        return snap

    # -- pruning --------------------------------------------------------------------------

    def prune(self, job: str, keep: int) -> list[tuple[int, int]]:
        """Keeps the ``keep`` newest complete steps; returns the versions removed."""
        complete = [m.version() for m in self.complete_steps(job, repair=False)]
        if not complete:
            return []
        keep_set = set(complete[:keep])
        victims = [v for v in self._versions(job)
                   if v not in keep_set and (v in complete or v < complete[0])]
        for version in victims:
            directory = self.step_dir(job, version)
            trash = os.path.join(self.job_dir(job), f".trash-{uuid.uuid4().hex[:12]}")
            try:
                os.rename(directory, trash)  # readers see the step whole or not at all
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
                    log.warning("persistent tier: cannot remove %s: %s", directory, exc)
                continue
            shutil.rmtree(trash, ignore_errors=True)
        for name in os.listdir(self.job_dir(job)):  # a pruner that crashed mid-delete
            if name.startswith(".trash-"):
                shutil.rmtree(os.path.join(self.job_dir(job), name), ignore_errors=True)
        return victims
