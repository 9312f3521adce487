"""EmbeddedEtcd(members=3) forms one cluster: a write through one member is read through the
others, and the cluster keeps serving after its leader is killed."""

from __future__ import annotations

import pytest

from elasticd.coordination.embedded import EmbeddedEtcd
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


def _client(endpoints: str) -> EtcdCoordinator:
    return EtcdCoordinator(EtcdSettings(parse_endpoints(endpoints), timeout=2.0))


def test_three_members_form_one_cluster_that_survives_its_leader():
    with EmbeddedEtcd(members=3) as server:
        one, two = _client(server.members[0].endpoint), _client(server.members[2].endpoint)
        try:
            one.put(b"/k", b"v1")
            assert two.get(b"/k").value == b"v1"
            leader = server.leader()
            leader.kill()
            rest = [m for m in server.members if m is not leader]
            server.wait_healthy(timeout=20, members=rest)
            survivor, other = _client(rest[0].endpoint), _client(rest[1].endpoint)
            try:
                survivor.put(b"/k", b"v2")
                assert other.get(b"/k").value == b"v2"
            finally:
                survivor.close()
                other.close()
            assert server.leader() is not leader
        finally:
            one.close()
            two.close()
