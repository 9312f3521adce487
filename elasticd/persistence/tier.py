"""The persistent tier's layout on disk, and the rules that keep it consistent across nodes.

::

    <root>/<job>/step-<generation>-<step>/rank-<r>.safetensors   one per rank, by its owner
                                         /rank-<r>.json          marker: size + xxh3 of the file
                                         /manifest.json          written last: the step is complete

Every file appears atomically (written to a unique temporary name, fsynced, renamed, the
directory fsynced), so a reader never sees half a file and a crash leaves only temporaries.
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

import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import uuid
from typing import Any

from elasticd.checkpoint.format import CorruptSnapshot, SnapshotHeader
from elasticd.persistence import safetensors_file
from elasticd.persistence.safetensors_file import PersistedSnapshot

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "elasticd-checkpoint"
MANIFEST_VERSION = 1
_STEP_RE = re.compile(r"step-(\d+)-(\d+)")
_MARKER_RE = re.compile(r"rank-(\d+)\.json")
_JOB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class TierError(Exception):
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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(directory: str, name: str) -> str:
    return os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")


def _write_json(path: str, obj: Any, mode: int) -> None:
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
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
        file_mode: permission bits of the files written.
    """

    def __init__(self, root: str, node_id: str = "", file_mode: int = 0o600) -> None:
        self.root, self.node_id, self.file_mode = root, node_id, file_mode
        os.makedirs(root, mode=0o755, exist_ok=True)

    def job_dir(self, job: str) -> str:
        if not isinstance(job, str) or not _JOB_RE.fullmatch(job):
            raise TierError(f"job name {job!r} must match {_JOB_RE.pattern}")
        return os.path.join(self.root, job)

    def step_dir(self, job: str, version: tuple[int, int]) -> str:
        return os.path.join(self.job_dir(job), f"step-{int(version[0])}-{int(version[1])}")

    # -- writing --------------------------------------------------------------------------

    def write_rank(self, header: SnapshotHeader, buffer: Any, uid: int | None = None) -> dict:
        """Writes one rank's snapshot and its marker; returns the marker's record."""
        directory = self.step_dir(header.job, header.version())
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._give(self.job_dir(header.job), uid)
        self._give(directory, uid)
        name = f"rank-{header.rank}.safetensors"
        tmp = _tmp_name(directory, name)
        nbytes, digest = safetensors_file.write(tmp, header, buffer, self.file_mode)
        self._give(tmp, uid)
        os.rename(tmp, os.path.join(directory, name))
        record = {"rank": header.rank, "file": name, "bytes": nbytes, "xxh3_64": f"{digest:016x}",
                  "world_size": header.world_size, "generation": header.generation,
                  "step": header.step, "node": self.node_id}
        tmp = _tmp_name(directory, f"rank-{header.rank}.json")
        _write_json(tmp, record, self.file_mode)
        self._give(tmp, uid)
        # The marker goes after the data file: a marker always names a complete file.
        os.rename(tmp, os.path.join(directory, f"rank-{header.rank}.json"))
        _fsync_dir(directory)
        return record

    def _give(self, path: str, uid: int | None) -> None:
        if uid is not None and os.geteuid() == 0 and uid != 0:
            os.chown(path, uid, -1)

    def try_finish(self, job: str, version: tuple[int, int], uid: int | None = None) -> bool:
        """Writes the step's manifest if every rank's marker is there and nobody has yet.

        Returns:
            True if this call created the manifest.
        """
        directory = self.step_dir(job, version)
        markers = self._markers(directory)
        if not markers:
            return False
        world = {m["world_size"] for m in markers.values()}
        if len(world) != 1 or set(markers) != set(range(world.pop())):
            return False
        manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "job": job,
                    "generation": int(version[0]), "step": int(version[1]),
                    "world_size": len(markers),
                    "ranks": [markers[r] for r in sorted(markers)]}
        tmp = _tmp_name(directory, MANIFEST)
        _write_json(tmp, manifest, self.file_mode)
        self._give(tmp, uid)
        try:
            os.link(tmp, os.path.join(directory, MANIFEST))
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        _fsync_dir(directory)
        return True

    def _markers(self, directory: str) -> dict[int, dict[str, Any]]:
        out = {}
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return out
        for name in names:
            match = _MARKER_RE.fullmatch(name)
            if not match:
                continue
            try:
                with open(os.path.join(directory, name), "rb") as f:
                    record = json.loads(f.read())
            except (OSError, ValueError) as exc:
                log.warning("persistent tier: unreadable marker %s/%s: %s", directory, name, exc)
                continue
            if isinstance(record, dict) and record.get("rank") == int(match.group(1)) \
                    and type(record.get("world_size")) is int:
                out[int(match.group(1))] = record
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
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
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
            repair: write the manifest of a step whose ranks are all there but that nobody
                completed (two writers that each missed the other's marker).
        """
        out = []
        for version in self._versions(job):
            m = self.manifest(job, version)
            if m is None and repair and self.try_finish(job, version):
                m = self.manifest(job, version)
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

    def remove_job(self, job: str) -> None:
        """Deletes every step of ``job``."""
        shutil.rmtree(self.job_dir(job), ignore_errors=True)
