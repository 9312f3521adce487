"""Non-finite numbers (nan, inf, -inf) are refused for every numeric setting of the daemon,
whether they come from a flag, the environment or the TOML file: nan passes every range check
(each comparison with it is False), so before this ``outage_grace = nan`` started a daemon."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from elasticd.config import ConfigError, Settings, load

FLOATS = [f.name for f in dataclasses.fields(Settings) if f.type == "float"]
INTS = [f.name for f in dataclasses.fields(Settings) if f.type == "int"]


def test_the_settings_under_test_are_the_ones_named_in_the_issue():
    assert {"outage_grace", "heartbeat_interval", "etcd_timeout"} <= set(FLOATS)
    assert "lease_ttl" in INTS


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "1e999"])
def test_flag_and_environment_refuse_non_finite(name, text):
    with pytest.raises(ConfigError) as exc:
        load({name: text}, None, {})
    flag = "--" + name.replace("_", "-")
    assert str(exc.value).startswith(f"{name} (from {flag}): {text!r} is not a finite number")
    assert "give seconds" in str(exc.value)
    env = "ELASTICD_" + name.upper()
    with pytest.raises(ConfigError, match=f"from environment {env}.*not a finite number"):
        load({}, None, {env: text})


@pytest.mark.parametrize("name", FLOATS + INTS)
@pytest.mark.parametrize("literal", ["nan", "inf", "-inf"])
def test_toml_refuses_non_finite(tmp_path, name, literal):
    f = tmp_path / "c.toml"
    f.write_text(f"[elasticd]\n{name} = {literal}\n")
    with pytest.raises(ConfigError) as exc:
        load({}, str(f), {})
    msg = str(exc.value)
    assert msg.startswith(f"{name} (from {f}):"), msg
    assert "not a finite number" in msg or "not a whole number" in msg, msg
    assert "\n" not in msg


def test_finite_values_still_load():
    s = load({"outage_grace": "12.5", "heartbeat_interval": "1"}, None,
             {"ELASTICD_STOP_GRACE": "3"})
    assert (s.outage_grace, s.heartbeat_interval, s.stop_grace) == (12.5, 1.0, 3.0)


def test_daemon_refuses_nan_outage_grace_in_one_line_exit_2():
    # Settings are checked before anything starts: no etcd is needed to see the refusal.
    res = subprocess.run([sys.executable, "-m", "elasticd.daemon.main", "--outage-grace", "nan",
                          "--etcd", "127.0.0.1:9"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "outage_grace (from --outage-grace): 'nan' is not a finite number" in lines[0]
