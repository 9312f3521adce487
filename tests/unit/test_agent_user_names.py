"""Agents' etcd user names: one per (job, node), whatever dots the names hold (issue 26,
finding 4), and which users under the old names a node may delete. The same against a real etcd
with auth: ``tests/integration/test_agent_etcd_role.py``."""

from __future__ import annotations

import itertools

from elasticd.coordination.agent_credentials import AgentCredentials, old_users_of
from elasticd.coordination.keys import Keyspace

NAMES = ["a", "b", "c", "a.b", "b.c", "a.b.c", "a-b", "a_b.c", "x.y.z"]


def test_no_two_job_node_pairs_share_a_user_name(tmp_path):
    keys = Keyspace("/elasticd")
    users = {}
    for job, node in itertools.product(NAMES, NAMES):
        name = AgentCredentials(None, keys, node, str(tmp_path)).user_name(job)
        assert name not in users, f"{(job, node)} and {users[name]} share {name}"
        users[name] = (job, node)


def test_old_users_deleted_are_the_nodes_own_and_unambiguous():
    users = ["elasticd-agent.t.j.c", "elasticd-agent.t.a.b.c", "elasticd-agent.t.j.d",
             "elasticd-agent.t.j@c", "elasticd-agent.u.j.c", "elasticd-agent.t..c", "root"]
    assert old_users_of(users, "t", "c", ["c", "b.c", "d"]) == ["elasticd-agent.t.j.c"]
    # b.c gone from the cluster: a.b.c can only be this node's now
    assert old_users_of(users, "t", "c", ["c", "d"]) == ["elasticd-agent.t.j.c",
                                                         "elasticd-agent.t.a.b.c"]
