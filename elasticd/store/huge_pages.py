"""Whether a node's checkpoint slots get huge pages, read from the mount that holds them.

A slot is reserved (``fallocate``) and mapped (a fault per page) whole before anything is copied
into it: on 4 KiB pages, 512 page operations per 2 MiB, eight times a memcpy of the same bytes;
on a tmpfs mounted with ``huge=within_size`` (or ``always``), 2 MiB pages and a seventh of
that (bench/results/slot_alloc.json). ``huge=advise`` does not do: ``fallocate`` reserves a
slot's pages before any mapping could advise them.

``/dev/shm`` is mounted without huge pages on most distributions, and the system-wide
``shmem_enabled`` knob can force or deny them for every tmpfs. The daemon reports the outcome
in ``/status`` (``shm``) and warns at start when its slots are on small pages; the systemd
directory ships a mount unit for a huge-page tmpfs (``run-elasticd-shm.mount``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

#: tmpfs ``huge=`` values under which the slot files get huge pages.
_HUGE = frozenset({"always", "within_size"})
MOUNTINFO = "/proc/self/mountinfo"
SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


@dataclass(frozen=True)
class SlotPages:
    """What backs a slot directory.

    Attributes:
        mount_point: the mount the directory is on.
        fs_type: its file system type (``tmpfs`` for a usable slot directory).
        huge: the tmpfs ``huge=`` option ("never" when absent).
        override: the system-wide ``shmem_enabled`` choice when it is ``force`` or ``deny``
            (which win over every mount's option), else "".
    """

    mount_point: str
    fs_type: str
    huge: str
    override: str = ""

    @property
    def huge_pages(self) -> bool:
        """Whether slot files here are backed by huge pages."""
        if self.fs_type != "tmpfs" or self.override == "deny":
            return False
        return self.override == "force" or self.huge in _HUGE

    def describe(self) -> str:
        """One line for a log or ``/status``."""
        if self.huge_pages:
            return f"huge pages ({self.fs_type} at {self.mount_point}, huge={self.huge})"
        why = (f"shmem_enabled={self.override}" if self.override == "deny"
               else f"{self.fs_type} at {self.mount_point}, huge={self.huge}")
        return f"4 KiB pages ({why})"


def parse_mountinfo(text: str, path: str) -> tuple[str, str, str]:
    """The (mount point, fs type, ``huge=`` value) of the mount holding the absolute ``path``,
    from the text of ``/proc/self/mountinfo`` (the last mount of the longest matching point,
    which is the one visible)."""
    best: tuple[str, str, str] = ("/", "", "never")
    for line in text.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 10:
            continue
        # mountinfo writes space, tab, newline and backslash in paths as octal escapes.
        point = re.sub(r"\\(040|011|012|134)", lambda m: chr(int(m[1], 8)), fields[4])
        _, _, tail = line.partition(" - ")
        fs_type, _source, super_options = (tail.split() + ["", ""])[:3]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            options = dict(o.split("=", 1) for o in super_options.split(",") if "=" in o)
            best = (point, fs_type, options.get("huge", "never"))
    return best


def parse_shmem_enabled(text: str) -> str:
    """``force`` or ``deny`` when the bracketed choice of ``shmem_enabled`` is one, else ""."""
    choice = next((w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")), "")
    return choice if choice in ("force", "deny") else ""


def probe(directory: str) -> SlotPages:
    """What backs ``directory`` (or its nearest existing parent) on this machine."""
    path = os.path.realpath(directory)
    try:
        with open(MOUNTINFO) as f:
            point, fs_type, huge = parse_mountinfo(f.read(), path)
    except OSError:
        point, fs_type, huge = "?", "?", "never"
    try:
        with open(SHMEM_ENABLED) as f:
            override = parse_shmem_enabled(f.read())
    except OSError:
        override = ""  # no transparent huge pages in this kernel: the mount option decides
    return SlotPages(point, fs_type, huge, override)
