"""Agents' etcd user names: one per (job, node), whatever dots the names hold (issue 26,
finding 4), and which users under the old names a node may delete. The same against a real etcd
with auth: ``tests/integration/test_agent_etcd_role.py``."""

from __future__ import annotations

import itertools
import types

import pytest

from elasticd.coordination.agent_credentials import PASSWORD_ENV, AgentCredentials, old_users_of
from elasticd.coordination.api import CoordinationError, Refused
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


class AuthEtcd:
    """etcd's user and role calls, as far as :class:`AgentCredentials` makes them; ``refuse``
    names calls etcd refuses, unapplied, once each (its auth store moving under them)."""

    def __init__(self, refuse=()):
        self.users, self.roles, self.calls = {}, {}, []
        self.refuse = list(refuse)

    def auth_call(self, method, req):
        self.calls.append(method)
        if method in self.refuse:
            self.refuse.remove(method)
            raise Refused("etcdserver: revision of auth store is old; refused for 1.0 s")
        if method == "RoleGet":
            if req.role not in self.roles:
                raise CoordinationError("etcdserver: role name not found")
            return types.SimpleNamespace(perm=list(self.roles[req.role]))
        if method == "RoleAdd":
            self.roles.setdefault(req.name, [])
        elif method == "RoleGrantPermission":
            self.roles[req.name].append(req.perm)
        elif method == "UserAdd":
            if req.name in self.users:
                raise CoordinationError("etcdserver: user name already exists")
            self.users[req.name] = (req.password, set())
        elif method == "UserChangePassword":
            self.users[req.name] = (req.password, self.users[req.name][1])
        elif method == "UserGet":
            if req.name not in self.users:
                raise CoordinationError("etcdserver: user name not found")
            return types.SimpleNamespace(roles=sorted(self.users[req.name][1]))
        elif method == "UserGrantRole":
            self.users[req.user][1].add(req.role)
        elif method == "UserList":
            return types.SimpleNamespace(users=sorted(self.users))
        elif method == "UserDelete":
            self.users.pop(req.name, None)
        return types.SimpleNamespace()

    def get_prefix(self, prefix):
        return [], 1


def test_an_issue_etcd_refused_midway_keeps_its_password_when_tried_again(tmp_path):
    """The daemon gives up on a request etcd keeps refusing while users change (past
    etcd_timeout) and tries the job's start again next cycle. A retry that set a new password
    made one more change of etcd's auth store, so more refusals, on every node starting the
    job: the retry keeps the password it set and changes nothing that holds."""
    etcd = AuthEtcd(refuse=["UserGrantRole"])
    creds = AgentCredentials(etcd, Keyspace("/elasticd"), "n1", str(tmp_path))
    spec = types.SimpleNamespace(name="job", user="nobody")
    with pytest.raises(Refused):
        creds.issue(spec)
    _, env = creds.issue(spec)
    user = creds.user_name("job")
    assert etcd.users[user] == (env[PASSWORD_ENV], {creds.job_role("job"), creds.node_role()})
    assert etcd.calls.count("UserAdd") + etcd.calls.count("UserChangePassword") == 1
    # A later start (the job's agent restarted) sets a fresh password, as before.
    _, again = creds.issue(spec)
    assert again[PASSWORD_ENV] != env[PASSWORD_ENV]
    assert etcd.users[user][0] == again[PASSWORD_ENV]
    # A user deleted since the refusal is created again.
    other = types.SimpleNamespace(name="job2", user="nobody")
    etcd.refuse = ["UserGrantRole"]
    with pytest.raises(Refused):
        creds.issue(other)
    del etcd.users[creds.user_name("job2")]
    _, env = creds.issue(other)
    assert etcd.users[creds.user_name("job2")][0] == env[PASSWORD_ENV]
