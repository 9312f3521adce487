"""EmbeddedEtcd's ``compaction`` reaches etcd: compacted by time (periodic mode, as
docs/operations.md recommends at scale), etcd compacts on its own within a few retentions, and
a watch from a compacted revision is told ``Compacted``, which every elasticd watch answers by
re-listing its prefix."""

from __future__ import annotations

import queue
import time

import pytest

from elasticd.coordination.api import Compacted
from elasticd.coordination.embedded import EmbeddedEtcd
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


def _compacted_from(client: EtcdCoordinator, revision: int, wait: float) -> bool:
    """Whether a watch from ``revision`` is told, within ``wait`` seconds, that etcd compacted it."""
    got: "queue.Queue[object]" = queue.Queue()
    watch = client.watch_prefix(b"/k", got.put, revision)
    try:
        return isinstance(got.get(timeout=wait), Compacted)
    except queue.Empty:
        return False
    finally:
        watch.cancel()


def test_periodic_compaction_compacts_the_history_on_etcds_own_clock():
    # A 1 s retention: etcd notes its revision every 0.1 s and compacts every second to the
    # revision of a second before (a minute in production: the same code at 60x).
    with EmbeddedEtcd(compaction=("periodic", "1s")) as server:
        client = EtcdCoordinator(EtcdSettings(parse_endpoints(server.endpoints), timeout=2.0))
        try:
            first = client.put(b"/k", b"0")
            deadline = time.monotonic() + 30
            compacted = False
            while not compacted and time.monotonic() < deadline:
                client.put(b"/k", b"1")  # the history moves on, as training's commits do
                compacted = _compacted_from(client, first, 0.5)
                time.sleep(0.1)
            assert compacted, "etcd never compacted the first revision in 30 s"
            # The present is kept: a watch from the newest revision is not compacted.
            assert not _compacted_from(client, client.put(b"/k", b"2"), 0.5)
        finally:
            client.close()
