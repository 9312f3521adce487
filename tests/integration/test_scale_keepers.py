"""The scale simulator's keep-alive process (bench/scale_native.py ``KeeperProcess``) on real
etcd: the leases handed to it live on for several TTLs from the moment it returns, a lease
gone on the server is handed back to elasticd's own ``LeaseKeeper.step`` (which re-grants), and
a removed lease (a killed node) is refreshed no more; a refresh etcd answers late is waited for
up to the client's timeout, as elasticd's keeper waits, not handed back to a busy simulator
process."""

from __future__ import annotations

import concurrent.futures
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from elasticd.coordination.api import LeaseLost
from elasticd.coordination.health import EtcdHealth
from elasticd.coordination.lease import LeaseKeeper
from tests.conftest import connect

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
def test_a_refresh_answered_late_is_waited_for_while_the_simulator_process_is_busy(
        private_etcd):
    """etcd paused for 2 s (TTL 3) answers a refresh 1.3 s after it was sent, while the
    simulator process is too busy to run a keeper's step (its pool held 6 s, as hundreds of
    joining agents held it at N = 1,000). The keep-alive process waits for the answer, as
    elasticd's keeper waits up to its client timeout, and goes on refreshing: the lease lives.
    Before, it handed the refresh back after 1 s and refreshed no more; the busy process
    stepped it after the lease had expired: lost and re-granted (22,380 times in an N = 1,000
    join). A second keep-alive process with a 1 s client timeout hands its lease back."""
    import scale_native

    endpoint = private_etcd.endpoints.split(",")[0].split("://")[-1]
    coord = connect(private_etcd, timeout=10.0)
    with concurrent.futures.ThreadPoolExecutor(2) as starting:  # ~3 s each: side by side
        patient, hasty = starting.map(lambda timeout: scale_native.KeeperProcess(
            endpoint, ttl=3, streams=1, workers=1, client="raw", timeout=timeout), (10.0, 1.0))
    member = private_etcd.members[0]
    busy = threading.Event()
    try:
        kept, other = (LeaseKeeper(coord, 3, EtcdHealth(describe="test")) for _ in range(2))
        kept.grant()
        other.grant()
        patient.add(kept)  # its first refresh goes out 1 s (TTL/3) from now
        hasty.add(other)
        patient._pool.submit(busy.wait, 6.0)  # the simulator process busy until then
        time.sleep(0.3)
        member.signal(signal.SIGSTOP)
        try:
            time.sleep(2.0)  # the refreshes sent at 1 s wait 1.3 s for etcd's answer
        finally:
            member.signal(signal.SIGCONT)
        time.sleep(4.0)  # past the busy 6 s and more than a TTL after the late answers
        assert kept.take_lost() == [] and other.take_lost() == []
        coord.keep_alive(kept.lease)  # raises LeaseLost if it expired
        coord.keep_alive(other.lease)
        assert patient.handed_back == {"gone": 0, "timeout": 0}
        assert hasty.handed_back["timeout"] == 1, hasty.handed_back
    finally:
        busy.set()
        member.signal(signal.SIGCONT)
        patient.close()
        hasty.close()
        coord.close()


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
