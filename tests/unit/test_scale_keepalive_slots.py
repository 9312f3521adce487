"""The scale simulator's keep-alive streams: with --keepalive-stream-per-lease each lease of a
node has a stream of its own, as a real node's daemon and agent each hold a connection (etcd
renews a stream's leases one after the other, each waiting for its apply loop)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import scale_native  # noqa: E402 - bench/ is not a package
from refresh_plan import RefreshPlan  # noqa: E402


def _streams(indices: list[int], per_lease: int, streams: int) -> list[int]:
    plan = RefreshPlan(streams, by_node=True)
    out = []
    for k, i in enumerate(indices):
        for lease, slot in zip((2 * i + 1000, 2 * i + 1001),
                               scale_native.keepalive_slots(k, i, per_lease)):
            plan.add(lease, slot, 0.0, 0.0)
            out.append(plan.stream(lease))
    return out


def test_per_lease_every_lease_of_a_process_has_a_stream_of_its_own():
    indices = list(range(3, 1000, 8))  # a process's nodes (every 8th), 125 of them
    streams = _streams(indices, 1, 2 * len(indices))
    assert len(set(streams)) == len(streams) == 250


def test_by_default_a_nodes_two_leases_share_its_stream():
    indices = list(range(3, 1000, 8))
    streams = _streams(indices, 0, len(indices))
    assert all(a == b for a, b in zip(streams[::2], streams[1::2]))
