"""etcd as a security boundary: user/password auth and TLS client certificates, for real.

A daemon with the right credentials joins; wrong or missing credentials are a clear,
one-line error (exit 2) and nothing is written."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from elasticd.coordination.api import AuthError, CoordinationError, Put, Unavailable
from elasticd.coordination.embedded import EmbeddedEtcd
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(90)]


def etcdctl(endpoint, *args):
    env = {**os.environ, "ETCDCTL_API": "3"}
    res = subprocess.run(["etcdctl", "--endpoints", endpoint, *args], env=env,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout


def daemon(*args, env=None):
    return subprocess.run([sys.executable, "-m", "elasticd.daemon.main", "--node-id", "s1",
                           "--listen", "127.0.0.1:0", *args],
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def auth_etcd(private_etcd):
    ep = private_etcd.members[0].endpoint
    etcdctl(ep, "user", "add", "root", "--new-user-password", "rootpw")
    etcdctl(ep, "user", "add", "elasticd", "--new-user-password", "s3cret")
    etcdctl(ep, "role", "add", "elasticd")
    etcdctl(ep, "role", "grant-permission", "elasticd", "--prefix=true", "readwrite", "/elasticd/")
    etcdctl(ep, "user", "grant-role", "elasticd", "elasticd")
    etcdctl(ep, "auth", "enable")
    return private_etcd


def test_user_password_auth(auth_etcd):
    ep = parse_endpoints(auth_etcd.endpoints)
    good = EtcdCoordinator(EtcdSettings(ep, user="elasticd", password="s3cret"))
    try:
        good.put(b"/elasticd/x", b"1")
        assert good.get(b"/elasticd/x").value == b"1"
        with pytest.raises(AuthError):  # outside the role's prefix
            good.put(b"/other/x", b"1")
    finally:
        good.close()
    bad = EtcdCoordinator(EtcdSettings(ep, user="elasticd", password="wrong"))
    with pytest.raises(AuthError, match="refused our credentials"):
        bad.get(b"/elasticd/x")
    bad.close()
    anon = EtcdCoordinator(EtcdSettings(ep))
    with pytest.raises(AuthError):
        anon.put(b"/elasticd/y", b"1")
    anon.close()

    res = daemon("--etcd", auth_etcd.endpoints, "--etcd-user", "elasticd",
                 env={"ELASTICD_ETCD_PASSWORD": "wrong"})
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1
    assert "refused our credentials" in res.stderr


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture
def certs(tmp_path):
    d = str(tmp_path)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.pem", "-days", "1", "-subj", "/CN=elasticd-test-ca", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
                      ("client", "extendedKeyUsage=clientAuth"),
                      ("rogue", "extendedKeyUsage=clientAuth")):
        with open(os.path.join(d, f"{name}.ext"), "w") as fh:
            fh.write(ext + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        if name == "rogue":  # self-signed: not from our CA
            _openssl("x509", "-req", "-in", f"{name}.csr", "-signkey", f"{name}.key", "-out",
                     f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)
        else:
            _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                     "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile",
                     f"{name}.ext", cwd=d)
    return {k: os.path.join(d, f"{k}.pem") for k in ("ca", "server", "client", "rogue")} | {
        k + "_key": os.path.join(d, f"{k}.key") for k in ("server", "client", "rogue")}


def test_tls_client_certificates(certs):
    server = EmbeddedEtcd(tls=(certs["ca"], certs["server"], certs["server_key"]),
                          client_tls=(certs["ca"], certs["client"], certs["client_key"]))
    server.start()
    try:
        ep = parse_endpoints(server.endpoints)
        good = EtcdCoordinator(EtcdSettings(ep, ca_cert=certs["ca"], cert=certs["client"],
                                            key=certs["client_key"]))
        try:
            good.put(b"/elasticd/tls", b"ok")
            assert good.get(b"/elasticd/tls").value == b"ok"
        finally:
            good.close()
        rogue = EtcdCoordinator(EtcdSettings(ep, timeout=1.0, ca_cert=certs["ca"],
                                             cert=certs["rogue"], key=certs["rogue_key"]))
        with pytest.raises(CoordinationError):
            rogue.get(b"/elasticd/tls")
        rogue.close()
        plain = EtcdCoordinator(EtcdSettings(ep, timeout=1.0))
        with pytest.raises(Unavailable):
            plain.get(b"/elasticd/tls")
        plain.close()
        # elasticctl with the right files reads what the daemon side wrote.
        res = subprocess.run(
            [sys.executable, "-m", "elasticd.cli.main", "nodes", "--format", "json", "--etcd",
             server.endpoints, "--etcd-ca-cert", certs["ca"], "--etcd-cert", certs["client"],
             "--etcd-key", certs["client_key"]], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == "[]"
    finally:
        server.stop()



def test_a_change_to_etcds_users_does_not_fail_a_logged_in_client(auth_etcd):
    """etcd refuses, unapplied, a request whose token is older than a user or role change that
    committed between the request's arrival and its apply ("revision of auth store is old"; CI:
    `elasticctl submit` failed so while the daemons created their agents' users). The client
    repeats it, as etcd's own client does, while users keep changing every 0.2 s."""
    from pyetcd import etcdrpc

    ep = parse_endpoints(auth_etcd.endpoints)
    root = EtcdCoordinator(EtcdSettings(ep, timeout=10, user="root", password="rootpw"))
    client = EtcdCoordinator(EtcdSettings(ep, timeout=10, user="elasticd", password="s3cret"))
    client.put(b"/elasticd/x", b"start")  # logged in before the churn (see _repeat_stale)
    stop = threading.Event()
    churned = []

    def churn():
        while not stop.is_set():
            name = f"churn{len(churned) % 4}"
            root.auth_call("UserAdd", etcdrpc.AuthUserAddRequest(name=name, password="pw"))
            root.auth_call("UserDelete", etcdrpc.AuthUserDeleteRequest(name=name))
            churned.append(name)
            stop.wait(0.2)

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        i = 0
        while len(churned) < 10:
            i += 1
            client.put(b"/elasticd/x", str(i).encode())
            client.transaction([], [Put(b"/elasticd/y", str(i).encode())])
        assert client.get(b"/elasticd/x").value == str(i).encode()
    finally:
        stop.set()
        t.join(timeout=10)
        client.close()
        root.close()
