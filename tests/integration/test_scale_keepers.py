"""The scale simulator's keep-alive process (bench/scale_native.py ``KeeperProcess``) on real
etcd: the leases handed to it live on for several TTLs from the moment it returns, a lease
gone on the server is handed back to elasticd's own ``LeaseKeeper.step`` (which re-grants), and
a removed lease (a killed node) is refreshed no more."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from elasticd.coordination.api import LeaseLost
from elasticd.coordination.health import EtcdHealth
from elasticd.coordination.lease import LeaseKeeper

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = [pytest.mark.etcd]


@pytest.mark.timeout(60)
def test_the_keep_alive_process_keeps_hands_back_and_forgets_leases(etcd, etcd_client):
    import scale_native

    keepers = scale_native.KeeperProcess(etcd.endpoints.split(",")[0].split("://")[-1],
                                         ttl=1, streams=2, workers=2)
    try:
        kept = [LeaseKeeper(etcd_client, 1, EtcdHealth(describe="test")) for _ in range(3)]
        for k in kept:
            k.grant()
            keepers.add(k)  # the process started before: a lease handed over is kept at once
        revoked, removed = kept[1].lease, kept[2].lease
        time.sleep(1.5)
        etcd_client.revoke_lease(revoked)  # gone on the server: step() re-grants
        keepers.remove(kept[2])
        time.sleep(3.0)  # three TTLs
        etcd_client.keep_alive(kept[0].lease)  # raises LeaseLost if it expired
        assert kept[0].take_lost() == []
        assert kept[1].take_lost() == [revoked] and kept[1].lease not in (None, revoked)
        etcd_client.keep_alive(kept[1].lease)
        with pytest.raises(LeaseLost):
            etcd_client.keep_alive(removed)
        assert keepers.cpu() > 0
    finally:
        keepers.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("client", ["aio", "raw"])
def test_the_daemons_node_watches_count_each_watchers_events_until_cancelled(etcd, etcd_client,
                                                                            client):
    """Each simulated daemon's ``nodes/`` watch has its own watch ID and counts what etcd sent
    it, from its own start revision, on streams shared with other daemons; a cancelled watch
    counts no more. The same on grpc.aio and on the streams written by hand."""
    import scale_native

    prefix = f"/scale-watch-{client}/nodes/".encode()
    endpoint = etcd.endpoints.split(",")[0].split("://")[-1]
    loop = scale_native.LoopThread()
    pool = (scale_native.RawNodeWatchPool(loop, endpoint, 2) if client == "raw"
            else scale_native.NodeWatchPool(loop, endpoint, 2))
    etcd_client.put(prefix + b"a", b"x" * 400)
    _, revision = etcd_client.get_prefix(prefix)
    # The daemons' listing without elasticd's decoding reads the same revision.
    assert scale_native.RawLister(endpoint)(prefix) == revision
    first, cancel_first = pool.watch(prefix, revision + 1)
    etcd_client.put(prefix + b"b", b"x" * 400)
    _, revision = etcd_client.get_prefix(prefix)
    second, _ = pool.watch(prefix, revision + 1)
    third, _ = pool.watch(prefix, revision + 1)
    for k in range(200):  # more than one read's worth of frames
        etcd_client.put(prefix + b"c%d" % k, b"x" * 400)
    etcd_client.delete(prefix + b"a")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (first[0], second[0], third[0]) != (202, 201, 201):
        time.sleep(0.05)
    assert (first[0], second[0], third[0]) == (202, 201, 201)
    cancel_first()
    time.sleep(0.3)
    etcd_client.put(prefix + b"d", b"x")
    while time.monotonic() < deadline and second[0] != 202:
        time.sleep(0.05)
    time.sleep(0.3)
    assert (first[0], second[0], third[0]) == (202, 202, 202)
