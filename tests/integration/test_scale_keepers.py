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
