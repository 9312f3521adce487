"""A slot the daemon pinned for a worker's read is released whatever happens to the read."""

from __future__ import annotations

import os
import tempfile

import pytest

from elasticd.worker.sources import Sources


class Transport:
    """Answers ``ckpt_fetch`` / ``ckpt_open`` with a pinned slot whose file is ``size`` short;
    records the releases."""

    def __init__(self, fds: list[int]) -> None:
        self.fds, self.released = fds, []

    def call(self, op, **kw):
        if op == "ckpt_release":
            self.released.append(kw["pin"])
            return {}
        return {"pin": 7, "_fds": self.fds, "offset": 0, "size": 1 << 20, "path": "slot"}

    def send(self, op, **kw):
        return False  # one-way dropped: the release goes as a call


@pytest.mark.parametrize("in_place", [False, True])
def test_a_slot_that_cannot_be_mapped_is_still_released(in_place):
    # A file shorter than the reply says: map_fd refuses it. In place, the pin used to stay
    # held until the daemon dropped the worker's pins (the piece never took it).
    with tempfile.TemporaryFile() as f:
        transport = Transport([os.dup(f.fileno())])
        sources = Sources(transport, "job", 0, 2)
        with pytest.raises(ValueError, match="not a slot file"):
            sources._from_daemon("ckpt_fetch", (0, 5), 2, [], rank=1, in_place=in_place)
    assert transport.released == [7]


def test_a_reply_without_its_descriptor_releases_the_pin():
    transport = Transport([])
    with pytest.raises(RuntimeError, match="descriptors"):
        Sources(transport, "job", 0, 2)._from_daemon("ckpt_open", (0, 5), 2, [], in_place=True)
    assert transport.released == [7]
