"""Agents on an etcd with authentication: each gets an etcd user of its own whose role may
write only its job's rendezvous prefix (issue 13, finding 8). Real etcd with auth enabled, real
daemons, real torchrun agents."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import pytest

from elasticd.cluster.jobspec import JobSpec
from elasticd.coordination.agent_credentials import PASSWORD_ENV, AgentCredentials
from elasticd.coordination.api import AuthError, Compare, Put
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.coordination.keys import Keyspace
from elasticd.launcher import JOB_USER, LocalCluster

pytestmark = [pytest.mark.etcd]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "examples", "train.py")
ROOT = {"user": "root", "password": "rootpw"}


def etcdctl(endpoint, *args):
    res = subprocess.run(["etcdctl", "--endpoints", endpoint, *args],
                         env={**os.environ, "ETCDCTL_API": "3"}, capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.fixture
def auth_etcd(private_etcd):
    """etcd with authentication on; the daemons log in as root (they manage agents' users)."""
    ep = private_etcd.members[0].endpoint
    etcdctl(ep, "user", "add", "root", "--new-user-password", ROOT["password"])
    etcdctl(ep, "auth", "enable")
    return private_etcd


def client(server, **creds):
    return EtcdCoordinator(EtcdSettings(parse_endpoints(server.endpoints), timeout=2.0, **creds))


class CountingRoot:
    """A root client that counts the auth calls that changed etcd's users or roles (a refused
    one, such as adding a user that exists, changes nothing)."""

    READS = {"RoleGet", "UserGet", "UserList"}

    def __init__(self, coord):
        self.coord, self.changes = coord, []

    def __getattr__(self, name):
        return getattr(self.coord, name)

    def auth_call(self, method, request):
        answer = self.coord.auth_call(method, request)
        if method not in self.READS:
            self.changes.append(method)
        return answer


@pytest.mark.timeout(60)
def test_a_jobs_start_changes_etcds_auth_store_only_where_needed(auth_etcd, tmp_path):
    """Each change of etcd's users or roles makes etcd repeat every log-in under way and refuse
    writes that race it (bench/scale_credentials.py): the job's role is made and granted by its
    first node only, a node's role once, a restarted daemon only sets a new password."""
    keys = Keyspace("/elasticd")
    root = client(auth_etcd, **ROOT)
    spec = JobSpec(name="j1", nnodes_min=1, nnodes_max=2, nproc_per_node=1, script=TRAIN,
                   args=[], script_sha256="0" * 64, user="nobody", cwd=str(tmp_path))
    try:
        issued = {}
        counts = {}
        for node in ("n1", "n2", "n1"):
            counting = CountingRoot(root)
            conf, env = AgentCredentials(counting, keys, node, str(tmp_path / node)).issue(spec)
            issued[node] = (conf["user"], env[PASSWORD_ENV])
            counts.setdefault(node, []).append(sorted(counting.changes))
        assert counts["n1"][0] == sorted(["RoleAdd", "RoleGrantPermission", "RoleAdd",
                                          "RoleGrantPermission", "UserAdd", "UserGrantRole",
                                          "UserGrantRole"])
        assert counts["n2"][0] == sorted(["RoleAdd", "RoleGrantPermission", "UserAdd",
                                          "UserGrantRole", "UserGrantRole"])  # its node's role
        assert counts["n1"][1] == ["UserChangePassword"]  # a restarted daemon
        for node, (user, password) in issued.items():
            agent = client(auth_etcd, user=user, password=password)
            try:
                agent.put(keys.rendezvous("j1").prefix + node.encode(), b"1")
                assert agent.get(keys.node(node)) is None  # may read its node's record
                with pytest.raises(AuthError):
                    agent.get(keys.node("n2" if node == "n1" else "n1"))
            finally:
                agent.close()
    finally:
        root.close()


@pytest.mark.timeout(60)
def test_the_agents_role_can_write_nothing_outside_its_rendezvous_prefix(auth_etcd, tmp_path):
    keys = Keyspace("/elasticd")
    root = client(auth_etcd, **ROOT)
    creds = AgentCredentials(root, keys, "n1", str(tmp_path / "files"))
    spec = JobSpec(name="j1", nnodes_min=1, nnodes_max=1, nproc_per_node=1, script=TRAIN,
                   args=[], script_sha256="0" * 64, user="nobody", cwd=str(tmp_path))
    root.put(keys.node("n1"), b"node record")
    root.put(keys.job_keys("j1").spec, b"spec")
    conf, env = creds.issue(spec)
    assert conf == {"user": creds.user_name("j1")} and set(env) == {PASSWORD_ENV}
    again_conf, again_env = creds.issue(spec)  # a restarted daemon: same user, new password
    assert again_conf == conf and again_env != env
    agent = client(auth_etcd, user=conf["user"], password=again_env[PASSWORD_ENV])
    try:
        # What the rendezvous does: read/write/compare-and-set its keys, a lease for its
        # alive key, and read its node's record (the daemon watch).
        rdzv = keys.rendezvous("j1").prefix
        agent.put(rdzv + b"state", b"1")
        assert agent.create(rdzv + b"store/k", b"v") and not agent.create(rdzv + b"store/k", b"v")
        lease = agent.grant_lease(5)
        agent.put(rdzv + b"alive/n1", b"", lease)
        # ... write its join record only while its node's record holds the lease it names
        # (elasticd/rendezvous/join.py: a compare reads that record)
        named = [Compare(keys.node("n1"), 0, "lease")]  # the record above has no lease
        assert agent.transaction(named, [Put(rdzv + b"native/nodes/n1", b"j", lease)])[0]
        assert agent.get_prefix(rdzv)[0]
        assert agent.get(keys.node("n1")).value == b"node record"
        # ... and watch it (the daemon watch follows it rather than reading it every 0.25 s).
        seen = threading.Event()
        watch = agent.watch_key(keys.node("n1"), lambda batch: seen.set(),
                                agent.revision(keys.node("n1")) + 1)
        root.put(keys.node("n1"), b"node record, rewritten")
        assert seen.wait(10)
        watch.cancel()
        agent.revoke_lease(lease)
        j1, r1 = keys.job_keys("j1"), keys.replication("j1")
        outside_writes = [j1.spec, j1.control, j1.node("n1"),
                          r1.placement, r1.ckpt + b"committed",
                          keys.rendezvous("j2").prefix + b"state", keys.job("j1")[:-1] + b"rdzvx",
                          keys.node("n1"), keys.node("n2"), keys.drain("n1"),
                          keys.events + b"n1/0/failed", b"/other"]
        for key in outside_writes:
            with pytest.raises(AuthError):
                agent.put(key, b"x")
            with pytest.raises(AuthError):
                agent.delete(key)
        for key in (keys.job_keys("j1").spec, keys.node("n2"), keys.jobs):
            with pytest.raises(AuthError):
                agent.get(key)
        with pytest.raises(AuthError):
            agent.get_prefix(keys.jobs)
        with pytest.raises(AuthError):  # no user management either
            AgentCredentials(agent, keys, "n1", str(tmp_path / "x")).issue(
                JobSpec(**{**spec.__dict__, "name": "j2"}))
    finally:
        agent.close()
    creds.withdraw("j1")  # the job ended here: its user is gone
    gone = client(auth_etcd, user=conf["user"], password=again_env[PASSWORD_ENV])
    with pytest.raises(AuthError):
        gone.get(rdzv + b"state")
    gone.close()
    root.close()


@pytest.mark.timeout(120)
def test_a_job_rendezvouses_on_an_etcd_with_authentication(auth_etcd, tmp_path):
    """On main the agents got no credentials (rdzv_conf() had none and ELASTICD_* was
    stripped): every rendezvous was refused and the job never trained."""
    env = {"ELASTICD_ETCD_USER": "root", "ELASTICD_ETCD_PASSWORD": ROOT["password"]}
    cluster = LocalCluster(["n1", "n2"], workdir=str(tmp_path), etcd=auth_etcd.endpoints,
                           env=env, etcd_client=ROOT)
    try:
        cluster.start()
        res = subprocess.run(
            [sys.executable, "-m", "elasticd.cli.main", "submit", "job", "--nnodes", "2",
             "--nproc-per-node", "1", "--user", JOB_USER, "--", TRAIN, "--steps", "400"],
            env={**os.environ, **env, "ELASTICD_ETCD": cluster.etcd,
                 "ELASTICD_PREFIX": cluster.prefix},
            capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr

        def logs():
            out = {}
            for n in ("n1", "n2"):
                try:
                    with open(tmp_path / n / "jobs" / "job" / "agent.log", errors="replace") as f:
                        out[n] = f.read()
                except FileNotFoundError:
                    out[n] = ""
            return out

        cluster.wait_for(lambda: all(re.search(r"step \d+ world 2", t) for t in logs().values()),
                         90, "both nodes training at world 2")
        # The agent logged in as its own user; its password is in no process' argv.
        agents = [pid for node in cluster.nodes.values() for pid in node.tagged()
                  if b"elasticd.agent.torchrun" in open(f"/proc/{pid}/cmdline", "rb").read()]
        assert agents
        for pid in agents:
            argv = open(f"/proc/{pid}/cmdline", "rb").read()
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            assert b"user=elasticd-agent." in argv
            password = [e for e in environ if e.startswith(PASSWORD_ENV.encode() + b"=")]
            assert len(password) == 1 and password[0].split(b"=", 1)[1] not in argv
            assert ROOT["password"].encode() not in b"".join(environ)  # not the daemon's
    finally:
        cluster.stop()


def _spec(name: str, tmp_path) -> JobSpec:
    return JobSpec(name=name, nnodes_min=1, nnodes_max=1, nproc_per_node=1, script=TRAIN,
                   args=[], script_sha256="0" * 64, user="nobody", cwd=str(tmp_path))


@pytest.mark.timeout(60)
def test_job_and_node_names_with_dots_no_longer_share_an_agent_user(auth_etcd, tmp_path):
    """Issue 26, finding 4: job ``a.b`` on node ``c`` and job ``a`` on node ``b.c`` were one
    etcd user (``elasticd-agent.<tag>.a.b.c``): the second issue reset the first agent's
    password, the user held both jobs' roles, and the first job to end deleted it."""
    keys = Keyspace("/elasticd")
    root = client(auth_etcd, **ROOT)
    on_c = AgentCredentials(root, keys, "c", str(tmp_path / "c"))
    on_bc = AgentCredentials(root, keys, "b.c", str(tmp_path / "bc"))
    for node in ("c", "b.c"):
        root.put(keys.node(node), b"node record")
    conf_ab, env_ab = on_c.issue(_spec("a.b", tmp_path))
    conf_a, env_a = on_bc.issue(_spec("a", tmp_path))
    assert conf_ab["user"] != conf_a["user"]
    agents = [client(auth_etcd, user=conf_ab["user"], password=env_ab[PASSWORD_ENV]),
              client(auth_etcd, user=conf_a["user"], password=env_a[PASSWORD_ENV])]
    try:
        ab, a = agents
        ab.put(keys.rendezvous("a.b").prefix + b"state", b"1")  # its password was not reset
        a.put(keys.rendezvous("a").prefix + b"state", b"1")
        with pytest.raises(AuthError):  # and it holds its own job's role only
            ab.put(keys.rendezvous("a").prefix + b"state", b"x")
        with pytest.raises(AuthError):
            a.put(keys.rendezvous("a.b").prefix + b"state", b"x")
        on_c.withdraw("a.b")  # the first job to end takes its own user only
        a.put(keys.rendezvous("a").prefix + b"state", b"2")
        with pytest.raises(AuthError):
            ab.get(keys.rendezvous("a.b").prefix + b"state")
    finally:
        for agent in agents:
            agent.close()
        root.close()


@pytest.mark.timeout(60)
def test_agent_users_under_the_old_names_are_deleted_unless_another_node_may_own_them(
        auth_etcd, tmp_path):
    keys = Keyspace("/elasticd")
    root = client(auth_etcd, **ROOT)
    creds = AgentCredentials(root, keys, "c", str(tmp_path / "c"))
    old = f"elasticd-agent.{creds.tag}."
    for node in ("c", "b.c"):
        root.put(keys.node(node), b"node record")
    for user in ("j.c", "gone.c", "a.b.c", "j.d"):  # a.b.c: may be job a on live node b.c
        etcdctl(auth_etcd.members[0].endpoint, "--user", "root:" + ROOT["password"], "user",
                "add", old + user, "--new-user-password", "pw")
    conf, _ = creds.issue(_spec("j", tmp_path))
    users = set(etcdctl(auth_etcd.members[0].endpoint, "--user", "root:" + ROOT["password"],
                        "user", "list").split())
    assert conf["user"] == old + "j@c" and conf["user"] in users
    assert old + "j.c" not in users and old + "gone.c" not in users  # this node's: deleted
    assert old + "a.b.c" in users and old + "j.d" in users  # maybe another's; another's
    root.close()
