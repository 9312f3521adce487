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

import hmac
from typing import Protocol

from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from elasticd.replication.scatter import Spans
from elasticd.replication.seal import NONCE, BlockTags, one_time_tagger
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
                    or grown > max_frame or at != start + size):  # a run is consecutive
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
    """Checks each block of a run against its own tag once its last byte has landed, in order;
    a block that fails is refused then (the rest of the run is not read).

    The check is the snapshot's AEAD over the whole block where it lies, in one library call
    (``ChaCha20Poly1305(block key).encrypt(nonce, b"", block)``: the tag of an empty plaintext
    with the block as associated data, exactly what :func:`~elasticd.replication.seal.one_time_tagger` makes streamed),
    not fed piece by piece as ``recv_into`` returns them (slower: bench/results/run_check/).

    Args:
        aead: ``ChaCha20Poly1305`` under the snapshot's block key.
        offset: the snapshot offset of the run's first block (each block's nonce is its offset).
        blocks: ``(length, tag)`` of each block, in order.
        target: where the run's bytes land (exactly their length); :meth:`update` is given
            the pieces of it that have, in order. Possibly :class:`Spans` (a reshard's rows
            landing in the live tensors, the rest of their blocks in staging): a block lying
            in several of its parts is checked by the same tag streamed over the parts
            (:func:`~elasticd.replication.seal.one_time_tagger`), which needs ``key``.
        key: the block key ``aead`` was made with.
    """

    def __init__(self, aead: ChaCha20Poly1305, offset: int, blocks: list[tuple[int, bytes]],
                 target: "memoryview | Spans", key: bytes | None = None) -> None:
        self._aead, self._blocks, self._target, self._key = aead, blocks, target, key
        self._index = 0
        self._at = offset  # the snapshot offset of the block being received
        self._start = 0  # where it starts in target
        self._got = 0  # bytes of target landed
        #: ``{offset: (length, tag)}`` of the blocks checked so far.
        self.landed: dict[int, tuple[int, bytes]] = {}

    def update(self, piece: memoryview) -> None:
        self._got += len(piece)
        while (self._index < len(self._blocks)
               and self._start + self._blocks[self._index][0] <= self._got):
            self._finish()

    def _finish(self) -> None:
        length, tag = self._blocks[self._index]
        block = self._target[self._start : self._start + length]
        if isinstance(block, Spans):
            if self._key is None:
                raise ValueError("a block landing in several places needs the block key")
            tagger = one_time_tagger(self._key, self._at)
            for part in block.parts:
                tagger.update(part)
            made = tagger.tag()
        else:
            made = self._aead.encrypt(NONCE.pack(0, self._at), b"", block)
        if not hmac.compare_digest(made, tag):
            raise BlockTagMismatch(f"block of {length} bytes at offset {self._at} fails its "
                                   "block tag (the check its owner sealed it with): corrupt "
                                   "in the sender's memory, altered or moved in transit, or "
                                   "not the snapshot its owner sealed")
        self.landed[self._at] = (length, tag)
        self._at += length
        self._start += length
        self._index += 1
