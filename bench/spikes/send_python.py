"""Spike (issue 30, restore39): the Python a holder runs to send one 1 GiB fetch, with the
socket taken out: ``send_spans`` of 1,024 tagged 1 MiB blocks over a Channel (an authenticated
session: runs of pretagged blocks, each frame's prefix sealed) whose socket takes every byte of
a ``sendmsg`` at once without copying it. Whole snapshot (one span) and a striped piece's form
(8 MiB ranges with gaps). Thread CPU per GiB, median of 15 (after one warm-up). Run as::

    cpulock python bench/spikes/send_python.py
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from elasticd.replication.channel import Channel, frame_chunk, send_spans  # noqa: E402
from elasticd.replication.seal import BlockTags, FrameKey  # noqa: E402
from elasticd.replication.server import DEFAULT_CHUNK  # noqa: E402
from elasticd.replication.wire import Limits  # noqa: E402

MIB, BLOCKS = 1 << 20, 1024


class NullSocket(socket.socket):
    """Takes every byte of each send at once, copying nothing."""

    def sendmsg(self, buffers, *args):
        return sum(memoryview(b).nbytes for b in buffers)

    def sendall(self, data, *args):
        return None


def main() -> None:
    tags = BlockTags(bytes(16), {i * MIB: (MIB, os.urandom(16)) for i in range(BLOCKS)})
    view = memoryview(bytearray(BLOCKS * MIB))
    with NullSocket() as sock:
        channel = Channel(sock)
        channel.send_key = FrameKey(os.urandom(32))
        chunk, limit = frame_chunk(DEFAULT_CHUNK, Limits().max_frame), Limits().max_frame
        forms = {"whole": [(0, view)],
                 "ranges": [(o, view[o : o + 8 * MIB]) for o in range(0, BLOCKS * MIB, 16 * MIB)]}
        out = {}
        for name, spans in forms.items():
            gib = sum(len(p) for _, p in spans) / (1 << 30)
            send_spans(channel, spans, chunk, tags, limit)
            runs = []
            for _ in range(15):
                start = time.thread_time()
                send_spans(channel, spans, chunk, tags, limit)
                runs.append(time.thread_time() - start)
            out[name] = round(statistics.median(runs) / gib * 1000, 2)
    print({"python ms per GiB sent (median of 15)": out})


if __name__ == "__main__":
    main()
