"""Runs of blocks (replication protocol v6): consecutive blocks in one pretagged DATA frame.

A holder that kept the block tags a push brought (or the owner, which made them at seal time)
sends consecutive tagged blocks as one DATA frame: one header, one session tag over the
frame's prefix (offset, block count, each block's length and tag), the blocks' bytes in one
``sendmsg`` and never read on the way. The receiver checks each block against its own tag
as its bytes land (:class:`RunCheck`), so a relay that alters, moves, reorders or repeats a
block fails on that block. :mod:`elasticd.replication.channel` frames and reads them; this
module decides how pieces group into runs and checks a run's blocks.
"""

from __future__ import annotations

from typing import Protocol

from elasticd.replication.seal import BlockTags, Opener, one_time_tagger
from elasticd.replication.wire import MAX_RUN_BLOCKS, RUN, RUN_ENTRY, BlockTagMismatch


class RunSender(Protocol):
    """What :func:`send_runs` sends with (a :class:`~elasticd.replication.channel.Channel`)."""

    def send_run(self, offset: int, blocks: list[tuple[bytes, memoryview]]) -> None: ...

    def send_data(self, offset: int, chunk: memoryview) -> None: ...


def send_runs(channel: RunSender, pieces: list[tuple[int, memoryview]], tags: BlockTags,
               chunk: int, max_frame: int) -> int:
    """Sends tagged blocks in runs of consecutive ones (at most ``chunk`` bytes of blocks,
    MAX_RUN_BLOCKS and ``max_frame`` payload bytes a frame), other pieces as DATA tagged
    here; returns the frame count."""
    frames: int = 0
    run: list[tuple[bytes, memoryview]] = []
    start = size = 0
    for at, piece in pieces:
        tag = tags.tag_at(at, len(piece))
        grown = RUN.size + (len(run) + 1) * RUN_ENTRY.size + size + len(piece)
        if run and (tag is None or size + len(piece) > chunk or len(run) == MAX_RUN_BLOCKS
                    or grown > max_frame):
            channel.send_run(start, run)
            frames, run = frames + 1, []
        if tag is None:
            channel.send_data(at, piece)
            frames += 1
            continue
        if not run:
            start, size = at, 0
        run.append((tag, piece))
        size += len(piece)
    if run:
        channel.send_run(start, run)
        frames += 1
    return frames


class RunCheck:
    """Checks each block of a run against its own tag as its bytes arrive, in order; a block
    that fails is refused as soon as its last byte is in (the rest of the run is not read)."""

    def __init__(self, key: bytes, offset: int, blocks: list[tuple[int, bytes]]) -> None:
        self._key, self._blocks = key, blocks
        self._index, self._at, self._left = 0, offset, blocks[0][0]
        self._block = Opener(one_time_tagger(key, offset), blocks[0][1])
        #: ``{offset: (length, tag)}`` of the blocks checked so far.
        self.landed: dict[int, tuple[int, bytes]] = {}

    def update(self, piece: memoryview) -> None:
        while len(piece):
            take = min(self._left, len(piece))
            self._block.update(piece[:take])
            piece, self._left = piece[take:], self._left - take
            if not self._left:
                self._finish()

    def _finish(self) -> None:
        length, tag = self._blocks[self._index]
        if not self._block.verify():
            raise BlockTagMismatch(f"block of {length} bytes at offset {self._at} fails its "
                                   "block tag (the check its owner sealed it with): corrupt "
                                   "in the sender's memory, altered or moved in transit, or "
                                   "not the snapshot its owner sealed")
        self.landed[self._at] = (length, tag)
        self._at += length
        self._index += 1
        if self._index < len(self._blocks):
            self._left = self._blocks[self._index][0]
            self._block = Opener(one_time_tagger(self._key, self._at),
                                 self._blocks[self._index][1])
