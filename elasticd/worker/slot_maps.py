"""The worker's mappings of its snapshot slots, the two most recent, keyed on the file.

A slot comes as a descriptor of the file the daemon created (never re-opened by path). The two
most recent slots stay mapped, keyed on the file's identity (device, inode), which a reservation
names (``file``): for a file this worker says it still maps (:meth:`SlotMaps.mapped`), the
daemon sends no descriptor, so a save maps nothing new once both slots are known. Worker side.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from elasticd.snapshot.segment import map_fd
from elasticd.worker.copier import Copier, forget_views
from elasticd.worker.sources import handed_fd

__all__ = ["SlotMaps"]


class SlotMaps:
    """Up to two slot mappings.

    Args:
        copier: told to forget a mapping before it is closed.
    """

    def __init__(self, copier: Copier) -> None:
        self._copier = copier
        self._maps: dict[tuple[int, int], Any] = {}

    def mapped(self) -> list[list[int]]:
        """The files mapped, as a reservation names them (``mapped``)."""
        return [list(key) for key in self._maps]

    def map(self, reply: dict[str, Any]) -> Any:
        """The mapping of the slot a ``ckpt_reserve`` reply handed over.

        Raises:
            RuntimeError: the reply has no descriptor and names no file mapped here.
        """
        capacity = int(reply["capacity"])
        if not reply.get("_fds"):
            mm = self._maps.get(tuple(reply.get("file") or ()))
            if mm is None or len(mm) != capacity:
                raise RuntimeError("the daemon handed over no descriptor for a slot this "
                                   "worker does not map")
            return mm
        with handed_fd(reply) as fd:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            mm = self._maps.get(key)
            if mm is None or len(mm) != capacity:
                if len(self._maps) >= 2:  # double buffering: keep the two most recent slots
                    old = self._maps.pop(next(iter(self._maps)))
                    forget_views(old)
                    self._copier.forget(old)
                    with contextlib.suppress(BufferError):
                        old.close()
                mm = self._maps[key] = map_fd(fd, capacity, writable=True, populate=True)
            return mm

    def close(self) -> None:
        """Unmaps every slot (a view still held: closed when dropped)."""
        for mm in self._maps.values():
            forget_views(mm)
            with contextlib.suppress(BufferError):
                mm.close()
        self._maps.clear()
