"""The etcd-v3 rendezvous' settings: --rdzv-conf parsing, the keep-alive window, the entry point."""

from __future__ import annotations

import datetime
from importlib.metadata import entry_points

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elasticd.coordination.rendezvous import (
    create_rdzv_handler,
    handler_creator,
    keep_alive_settings,
)
from elasticd.coordination.rendezvous_config import PASSWORD_ENV, RendezvousConfig


def params(endpoint: str = "127.0.0.1:2379", run_id: str = "job", **conf: str
           ) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id, 1, 2, **conf)


def test_defaults():
    cfg = RendezvousConfig.from_params(params("10.0.0.1:2379,10.0.0.2:2379"))
    assert cfg.etcd.endpoints == (("10.0.0.1", 2379), ("10.0.0.2", 2379))
    assert cfg.etcd.timeout == 2.0 and not cfg.etcd.secure and cfg.etcd.user is None
    assert (cfg.key_prefix, cfg.grace_period, cfg.max_clock_skew) == ("/elasticd", 30.0, 2.0)
    assert cfg.store_timeout == datetime.timedelta(seconds=60)
    assert cfg.standby_fix is True
    assert (cfg.lease_liveness, cfg.liveness_ttl, cfg.liveness_confirm) == (True, 3, 1.0)


def test_settings_from_rdzv_conf(tmp_path, monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    files = {}
    for name in ("ca.pem", "cert.pem", "key.pem"):
        files[name] = tmp_path / name
        files[name].write_text("x")
    cfg = RendezvousConfig.from_params(params(
        key_prefix="/prod", etcd_timeout="0.5", etcd_grace_period="10", max_clock_skew="0.5",
        read_timeout="30", ca_cert=str(files["ca.pem"]), cert=str(files["cert.pem"]),
        key=str(files["key.pem"]), user="trainer", password="s3cret", standby_fix="false",
        lease_liveness="false", liveness_ttl="5", liveness_confirm="0"))
    assert (cfg.key_prefix, cfg.grace_period, cfg.max_clock_skew) == ("/prod", 10.0, 0.5)
    assert cfg.etcd.timeout == 0.5 and cfg.etcd.secure
    assert (cfg.etcd.user, cfg.etcd.password) == ("trainer", "s3cret")
    assert cfg.store_timeout == datetime.timedelta(seconds=30)
    assert cfg.standby_fix is False
    assert (cfg.lease_liveness, cfg.liveness_ttl, cfg.liveness_confirm) == (False, 5, 0.0)


def test_password_from_the_environment(monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    cfg = RendezvousConfig.from_params(params(user="trainer"))
    assert cfg.etcd.password == "from-env"


@pytest.mark.parametrize("endpoint, conf, message", [
    ("", {}, "needs --rdzv-endpoint"),
    ("localhost", {}, "is not HOST:PORT"),
    ("127.0.0.1:2379", {"etcd_grace_period": "-1"}, "etcd_grace_period='-1'"),
    ("127.0.0.1:2379", {"etcd_grace_period": "soon"}, "not a number"),
    ("127.0.0.1:2379", {"etcd_timeout": "0"}, "must be a positive"),
    ("127.0.0.1:2379", {"key_prefix": "elasticd/"}, "prefix"),
    ("127.0.0.1:2379", {"cert": "/c.pem"}, "cert and key go together"),
    ("127.0.0.1:2379", {"ca_cert": "/nonexistent/ca.pem"}, "no such file"),
    ("127.0.0.1:2379", {"user": "trainer"}, "needs both"),
    ("127.0.0.1:2379", {"read_timeout": "0"}, "read_timeout"),
    ("127.0.0.1:2379", {"liveness_ttl": "1"}, "liveness_ttl='1'.*at least 2"),
    ("127.0.0.1:2379", {"liveness_ttl": "2.5"}, "liveness_ttl='2.5'"),
    ("127.0.0.1:2379", {"liveness_confirm": "-1"}, "liveness_confirm='-1'"),
    ("127.0.0.1:2379", {"lease_liveness": "maybe"}, "lease_liveness='maybe'"),
    ("127.0.0.1:2379", {"poll_interval": "0"}, "poll_interval='0'"),
    ("127.0.0.1:2379", {"poll_interval": "0.01"}, "poll_interval='0.01'.*between"),
    ("127.0.0.1:2379", {"poll_interval": "2"}, "poll_interval='2'.*between"),
    ("127.0.0.1:2379", {"close_on_failure": "perhaps"}, "close_on_failure='perhaps'"),
])
def test_bad_settings_are_refused_and_quoted(endpoint, conf, message, monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    with pytest.raises(ValueError, match=message):
        RendezvousConfig.from_params(params(endpoint, **conf))


def test_bad_run_id_is_refused():
    with pytest.raises(ValueError, match="--rdzv-id"):
        RendezvousConfig.from_params(params(run_id="my job"))


@pytest.mark.parametrize("conf, grace, skew, expected", [
    ({}, 30, 2, (5, 8)),  # torch's 5 s interval; 40 s window > 30 + 2 + 5
    ({}, 0, 0, (5, 3)),  # never fewer than 3 attempts (standby nodes, docs/facts.md)
    ({"keep_alive_interval": "1"}, 2, 1, (1, 5)),  # tuned for fast recovery: 5 s > 2 + 1 + 1
    ({"keep_alive_interval": "1"}, 0.5, 0, (1, 3)),
    ({"keep_alive_max_attempt": "2"}, 30, 2, (5, 2)),  # the user's choice stands (warned)
])
def test_keep_alive_window_outlasts_the_grace_period(conf, grace, skew, expected):
    interval, attempts = keep_alive_settings(params(**conf), grace, skew)
    assert (interval, attempts) == expected
    if not conf.get("keep_alive_max_attempt"):
        assert interval * attempts > grace + skew + interval
        assert interval * attempts >= 3


def test_a_short_user_window_is_warned_about(caplog):
    keep_alive_settings(params(keep_alive_interval="1", keep_alive_max_attempt="2"), 30, 2)
    assert "keep-alive window 2s" in caplog.text
    assert "standby" in caplog.text


@pytest.mark.parametrize("conf", [{"keep_alive_interval": "0"},
                                  {"keep_alive_max_attempt": "-1"}])
def test_bad_keep_alive_values_are_refused(conf):
    with pytest.raises(ValueError, match="keep_alive"):
        keep_alive_settings(params(**conf), 30, 2)


def test_entry_point_returns_the_creator():
    (ep,) = [e for e in entry_points(group="torchrun.handlers") if e.name == "etcd-v3"]
    assert ep.load() is handler_creator
    assert handler_creator() is create_rdzv_handler


def test_torch_registry_knows_etcd_v3():
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    assert rendezvous_handler_registry._registry.get("etcd-v3") is create_rdzv_handler


def test_creator_builds_torchs_handler_with_our_keep_alive_and_disables_store_sharing(
        monkeypatch):
    # No etcd needed: building the handler does not talk to it yet.
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    handler = create_rdzv_handler(params(etcd_grace_period="30"))
    assert handler.get_backend() == "etcd-v3"
    assert handler.settings.keep_alive_interval == datetime.timedelta(seconds=5)
    assert handler.settings.keep_alive_max_attempt == 8
    assert handler.use_agent_store is False  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1


def test_creator_keeps_an_explicit_store_sharing_choice(monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    handler = create_rdzv_handler(params())
    assert handler.use_agent_store is True


def test_creator_binds_lease_liveness_to_torchs_node_without_talking_to_etcd():
    # The alive key is written by the backend's first call, not when the handler is built.
    handler = create_rdzv_handler(params(etcd_grace_period="0"))
    liveness = handler._state_holder._backend._liveness
    node = handler._this_node
    assert liveness.me == f"{node.addr}_{node.pid}_{node.local_id}"
    assert liveness.keeper.key.endswith(b"/jobs/job/rdzv/alive/" + liveness.me.encode())
    assert not liveness.active
    liveness.stop()


def test_creator_without_lease_liveness():
    handler = create_rdzv_handler(params(lease_liveness="false"))
    assert handler._state_holder._backend._liveness is None


def test_poll_interval_shortens_torchs_poll_and_cache_only(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from elasticd.coordination.rendezvous_poll import _PollDelay

    slept: list[float] = []
    original = dr._delay
    monkeypatch.setattr(dr, "_delay", lambda seconds: slept.append(seconds))
    handler = create_rdzv_handler(params(poll_interval="0.25", lease_liveness="false"))
    assert handler._state_holder._cache_duration == 0.25
    assert isinstance(dr._delay, _PollDelay)
    dr._delay.original = slept.append  # what torch's delay would have slept
    dr._delay._sleep = lambda s: slept.append(("poll", s))
    dr._delay(1)  # the executor's SYNC poll
    dr._delay((0, 0.3))  # the start-up skew: torch's own
    assert slept == [("poll", 0.25), (0, 0.3)]
    monkeypatch.setattr(dr, "_delay", original)


def test_default_poll_interval_leaves_torch_alone(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    original = dr._delay
    handler = create_rdzv_handler(params(lease_liveness="false"))
    assert dr._delay is original
    assert handler._state_holder._cache_duration == 1


def _end_agent(handler, failing: bool) -> None:
    """Calls ``handler.shutdown()`` the way torch's launch_agent does: from a ``finally``,
    with the run's exception propagating when it failed."""
    try:
        try:
            if failing:
                raise RuntimeError("the workers failed")
        except RuntimeError:
            raise
        finally:
            handler.shutdown()
    except RuntimeError:
        pass


@pytest.mark.parametrize("close_on_failure, failing, closes", [
    ("true", False, True),
    ("true", True, True),     # torch's behaviour: a failed agent ends the job everywhere
    ("false", False, True),   # a job that succeeded is over for the standby nodes too
    ("false", True, False),   # the daemon restarts the agent: leave the rendezvous open
])
def test_a_failing_agent_leaves_the_rendezvous_open_when_told(close_on_failure, failing, closes):
    handler = create_rdzv_handler(params(lease_liveness="false",
                                         close_on_failure=close_on_failure))
    calls: list[str] = []
    handler._close = lambda: calls.append("close")
    handler._stop_heartbeats = lambda: calls.append("stop heartbeats")
    _end_agent(handler, failing)
    assert ("close" in calls) is closes, calls
    assert "stop heartbeats" in calls
