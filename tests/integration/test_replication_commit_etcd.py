"""The commit record's compare-and-set transaction against a real etcd: racing writers never
move the committed (generation, step) backwards, and holder updates apply only to the version
still committed; a withdrawal fences off a commit decided from the record before it."""

from __future__ import annotations

import pytest

from elasticd.coordination.keys import Keyspace
from elasticd.replication.commit import read_committed, record_commit, update_holders
from tests.unit.test_replication_commit import committed, race
from tests.unit.test_replicator import withdrawal_fences_a_stale_commit

pytestmark = pytest.mark.etcd


def test_commit_transaction_on_real_etcd(etcd_client, prefix):
    keys = Keyspace(prefix)
    assert record_commit(etcd_client, keys, "j", committed(0, 5))[0]
    assert not record_commit(etcd_client, keys, "j", committed(0, 4))[0]
    assert not record_commit(etcd_client, keys, "j", committed(0, 5))[0]
    assert read_committed(etcd_client, keys, "j").version == (0, 5)
    assert update_holders(etcd_client, keys, "j", (0, 5), {0: ["b", "c"]}, 1.0).holders[0] == (
        "b", "c")
    assert record_commit(etcd_client, keys, "j", committed(1, 0))[0]
    assert update_holders(etcd_client, keys, "j", (0, 5), {0: ["x"]}, 2.0).version == (1, 0)


def test_racing_commit_writers_on_real_etcd(etcd_client, prefix):
    race(etcd_client, Keyspace(prefix), job="race")


def test_a_withdrawal_fences_a_stale_commit_on_real_etcd(etcd_client, prefix):
    withdrawal_fences_a_stale_commit(etcd_client, Keyspace(prefix))
