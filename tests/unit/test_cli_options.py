"""elasticctl's shared options and number checks, in-process (the subprocess runs against a real
etcd are in tests/integration/test_elasticctl_cli.py).

Every numeric flag of every command is found from the parser itself, so a flag added later is
covered too: ``nan``, ``inf`` and words are refused in one line with exit status 2."""

from __future__ import annotations

import argparse
import os

import pytest

from elasticd.cli import options
from elasticd.cli.main import build_parser

#: What each command needs besides the flag under test to parse.
REQUIRED = {
    "submit": ["j", "--nnodes", "1", "--nproc-per-node", "1", "/x.py"],
    "stop": ["j"], "logs": ["j"], "drain": ["n1"],
}


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _numeric_flags() -> list[tuple[str, str]]:
    out = []
    for name, p in _commands(build_parser()).items():
        for action in p._actions:
            if action.type is not None and action.option_strings:
                out.append((name, action.option_strings[0]))
    return out


NUMERIC = _numeric_flags()


def test_every_numeric_flag_the_issue_named_is_found():
    flags = {f for _, f in NUMERIC}
    assert {"--etcd-timeout", "--watch", "--limit", "--hang-timeout", "--wait", "--timeout",
            "--nproc-per-node", "--max-restarts"} <= flags, flags
    assert ("nodes", "--etcd-timeout") in NUMERIC and ("submit", "--hang-timeout") in NUMERIC


def _parse_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("elasticctl: error: ") and "--help)" in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("command,flag", NUMERIC)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999", "ten"])
def test_every_numeric_flag_refuses_non_finite_values(capsys, command, flag, value):
    # flag=value: argparse would take a bare "-inf" for an option
    line = _parse_error(capsys, [command, f"{flag}={value}", *REQUIRED.get(command, [])])
    assert f"argument {flag}" in line, line
    assert ("not a finite number" in line or "not a number" in line
            or "not a whole number" in line or "invalid int value" in line), line


@pytest.mark.parametrize("argv,needle", [
    (["--etcd-timeout", "0", "nodes"], "--etcd-timeout: 0 is out of range: use 0.1 to 600"),
    (["nodes", "--etcd-timeout", "-2"], "--etcd-timeout: -2 is out of range"),
    (["nodes", "--watch", "0"], "--watch: 0 is out of range"),
    (["history", "--limit", "0"], "--limit: 0 is out of range: use 1 to 100000 events"),
    (["stop", "j", "--wait", "-1"], "--wait: -1 is out of range: use 0 to 86400 seconds"),
    (["drain", "n1", "--timeout", "0"], "--timeout: 0 is out of range: use 1 to 86400 "
                                        "seconds (default 120)"),
])
def test_out_of_range_numbers_say_the_range(capsys, argv, needle):
    assert needle in _parse_error(capsys, argv)


def _args(argv, environ=None):
    return options.resolve(build_parser().parse_args(argv), environ or {})


def test_cluster_flags_before_after_environment_default():
    assert _args(["--etcd", "a:1", "nodes"]).etcd == "a:1"
    assert _args(["nodes", "--etcd", "a:1"]).etcd == "a:1"
    # given before and not after: the command's parser leaves it alone
    a = _args(["--etcd", "a:1", "--format", "json", "--etcd-timeout", "5", "nodes"])
    assert (a.etcd, a.format, a.etcd_timeout) == ("a:1", "json", 5.0)
    assert _args(["--etcd", "a:1", "nodes", "--etcd", "b:2"]).etcd == "b:2"
    env = {"ELASTICD_ETCD": "e:3", "ELASTICD_PREFIX": "/p", "ELASTICD_ETCD_CA_CERT": "/ca"}
    a = _args(["nodes"], env)
    assert (a.etcd, a.prefix, a.etcd_ca_cert) == ("e:3", "/p", "/ca")
    assert a.sources["etcd_ca_cert"] == "ELASTICD_ETCD_CA_CERT"
    a = _args(["nodes", "--etcd", "f:4"], env)
    assert (a.etcd, a.sources["etcd"]) == ("f:4", "--etcd")
    a = _args(["nodes"])
    assert (a.etcd, a.prefix, a.etcd_timeout, a.format, a.watch) == (
        "", "/elasticd", 2.0, "pretty", None)


def test_tls_file_checks_name_where_the_path_came_from(tmp_path):
    a = _args(["nodes"], {"ELASTICD_ETCD_KEY": str(tmp_path), "ELASTICD_ETCD_CERT": "/c",
                          "ELASTICD_ETCD_CA_CERT": "/nonexistent-ca"})
    with pytest.raises(options.UsageError, match="ELASTICD_ETCD_CA_CERT '/nonexistent-ca': "
                                                 "no such file"):
        options.check_tls_files(a)
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    a = _args(["nodes", "--etcd-ca-cert", str(ca), "--etcd-cert", str(ca)],
              {"ELASTICD_ETCD_KEY": str(tmp_path)})
    with pytest.raises(options.UsageError, match="ELASTICD_ETCD_KEY .*: is a directory"):
        options.check_tls_files(a)


@pytest.mark.parametrize("argv,env,needle", [
    (["nodes"], {}, "no etcd endpoint: pass --etcd HOST:PORT or set ELASTICD_ETCD"),
    (["nodes", "--etcd", "nohost"], {}, "--etcd: 'nohost' is not HOST:PORT: give HOST:PORT"),
    (["nodes"], {"ELASTICD_ETCD": "a:1", "ELASTICD_PREFIX": "bad"},
     "ELASTICD_PREFIX: prefix 'bad' is not valid"),
    (["--etcd-user", "u", "nodes", "--etcd", "a:1"], {},
     "--etcd-user and --etcd-password go together: give both"),
    (["--etcd", "a:1", "stop", "j", "--watch", "1"], {}, "--watch does not apply to stop"),
])
def test_usage_errors_before_etcd_is_asked(monkeypatch, capsys, argv, env, needle):
    from elasticd.cli.main import run

    for name in [k for k in os.environ if k.startswith("ELASTICD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert run(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elasticctl: error: ") and needle in lines[0]
