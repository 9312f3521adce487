"""Settings: precedence of file < environment < flags, and one clear error per bad value."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elasticd.config import ConfigError, load


def test_precedence_file_env_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[elasticd]\nnode_id = "from-file"\nlease_ttl = 7\nprefix = "/p"\n')
    s = load({"node_id": "from-flag"}, str(f), {"ELASTICD_LEASE_TTL": "9"})
    assert (s.node_id, s.lease_ttl, s.prefix) == ("from-flag", 9, "/p")


def test_defaults_derive():
    s = load({}, None, {})
    assert s.lease_ttl == 5 and s.heartbeat_interval == 0  # no timed rewrite: the lease
    assert s.provisional_seconds == 12.0
    assert s.etcd == ""


@pytest.mark.parametrize("cli,env,needle", [
    ({"lease_ttl": "1"}, {}, "lease_ttl (from --lease-ttl): 1 is out of range"),
    ({"lease_ttl": "abc"}, {}, "lease_ttl (from --lease-ttl): 'abc' is not a whole number"),
    ({}, {"ELASTICD_NODE_ID": "bad id"}, "node_id (from environment ELASTICD_NODE_ID)"),
    ({"etcd": "nohost"}, {}, "etcd (from --etcd): 'nohost' is not HOST:PORT"),
    ({"listen": "1.2.3.4"}, {}, "listen (from --listen)"),
    ({"prefix": "noslash"}, {}, "prefix (from --prefix)"),
    ({"etcd_user": "u"}, {}, "etcd_user and etcd_password must be given together"),
    ({"etcd_ca_cert": "/nonexistent.pem"}, {}, "does not exist"),
    ({}, {"ELASTICD_BOGUS": "1"}, "ELASTICD_BOGUS (from environment): unknown setting"),
    ({"etcd_timeout": "9"}, {}, "etcd_timeout"),
    ({}, {"ELASTICD_RDZV_GROW": "sometimes"}, "rdzv_grow (from environment ELASTICD_RDZV_GROW)"),
    ({"rdzv_grow": "interval:inf"}, {}, "rdzv_grow (from --rdzv-grow): grow policy "
                                        "'interval:inf': MIN in interval:MIN must be a finite"),
    ({}, {"ELASTICD_RDZV_GROW": "interval:-1"}, "'interval:-1': MIN in interval:MIN"),
    ({"replicas": "9"}, {}, "replicas (from --replicas): 9 is out of range: use 1 to 8"),
    ({"memory_cap_mib": "-1"}, {}, "memory_cap_mib (from --memory-cap-mib): -1 is out of range"),
    ({"worker_start": "WARM"}, {}, "worker_start (from --worker-start): 'WARM': use warm or cold"),
    ({"log_level": "loud"}, {}, "'loud': use DEBUG, INFO, WARNING or ERROR"),
    ({"agent_etcd_key": "k.pem"}, {}, "agent_etcd_cert and agent_etcd_key must be given"),
])
def test_bad_values_name_the_setting(cli, env, needle):
    with pytest.raises(ConfigError) as exc:
        load(cli, None, env)
    assert needle in str(exc.value)


def test_bad_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("node_id = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load({}, str(f), {})
    f.write_text("lease_tll = 3\n")
    with pytest.raises(ConfigError, match="lease_tll .*unknown setting"):
        load({}, str(f), {})
    with pytest.raises(ConfigError, match="does not exist"):
        load({}, str(tmp_path / "missing.toml"), {})


def _elasticd(*args, env=None):
    return subprocess.run([sys.executable, "-m", "elasticd.daemon.main", *args],
                          capture_output=True, text=True, timeout=30, env=env)


def test_cli_bad_value_is_one_line_exit_2():
    res = _elasticd("--lease-ttl", "0", "--etcd", "127.0.0.1:2379")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "lease_ttl" in lines[0] and "use 2 to 300" in lines[0]


def test_unreachable_etcd_is_one_line_exit_2():
    import socket

    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = _elasticd("--etcd", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "unreachable" in lines[0] and "check --etcd" in lines[0]


def test_missing_etcd_binary_is_one_line_exit_2(tmp_path):
    import os

    env = {**os.environ, "PATH": str(tmp_path)}  # no etcd here
    res = _elasticd("--listen", "127.0.0.1:0", env=env)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "apt-get install etcd-server" in lines[0]
