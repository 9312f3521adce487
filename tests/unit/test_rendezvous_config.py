"""The etcd-v3 rendezvous' settings: --rdzv-conf parsing, and the entry point."""

from __future__ import annotations

import datetime
import logging
from importlib.metadata import entry_points

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elasticd.testing.coordination import MemoryCoordinator
from elasticd.coordination.rendezvous import handler_creator, native_handler_creator
from elasticd.rendezvous.config import PASSWORD_ENV, HandlerSettings, RendezvousConfig
from elasticd.rendezvous.handler import EtcdNativeRendezvousHandler, create_handler


def params(endpoint: str = "127.0.0.1:2379", run_id: str = "job", backend: str = "etcd-v3",
           **conf: str) -> RendezvousParameters:
    return RendezvousParameters(backend, endpoint, run_id, 1, 2, **conf)


def test_defaults():
    cfg = RendezvousConfig.from_params(params("10.0.0.1:2379,10.0.0.2:2379"))
    assert cfg.etcd.endpoints == (("10.0.0.1", 2379), ("10.0.0.2", 2379))
    assert cfg.etcd.timeout == 2.0 and not cfg.etcd.secure and cfg.etcd.user is None
    assert (cfg.key_prefix, cfg.grace_period) == ("/elasticd", 30.0)
    h = cfg.handler
    assert (h.run_id, h.min_nodes, h.max_nodes, h.backend) == ("job", 1, 2, "etcd-v3")
    assert h.store_timeout == datetime.timedelta(seconds=60)
    assert (h.liveness_ttl, h.liveness_confirm) == (3, 1.0)
    assert (h.join_timeout, h.last_call, h.close_on_failure) == (600.0, 30.0, True)
    assert (h.grow, cfg.ignored) == ("immediate", ())


def test_settings_from_rdzv_conf(tmp_path, monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    files = {}
    for name in ("ca.pem", "cert.pem", "key.pem"):
        files[name] = tmp_path / name
        files[name].write_text("x")
    cfg = RendezvousConfig.from_params(params(
        key_prefix="/prod", etcd_timeout="0.5", etcd_grace_period="10", read_timeout="30",
        ca_cert=str(files["ca.pem"]), cert=str(files["cert.pem"]), key=str(files["key.pem"]),
        user="trainer", password="s3cret", liveness_ttl="5", liveness_confirm="0",
        join_timeout="60", last_call_timeout="0", close_on_failure="false", grow="at-failure"))
    assert (cfg.key_prefix, cfg.grace_period) == ("/prod", 10.0)
    assert cfg.etcd.timeout == 0.5 and cfg.etcd.secure
    assert (cfg.etcd.user, cfg.etcd.password) == ("trainer", "s3cret")
    h = cfg.handler
    assert h.store_timeout == datetime.timedelta(seconds=30)
    assert (h.liveness_ttl, h.liveness_confirm) == (5, 0.0)
    assert (h.join_timeout, h.last_call, h.close_on_failure) == (60.0, 0.0, False)
    assert h.grow == "at-failure"


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
    ("127.0.0.1:2379", {"join_timeout": "0"}, "join_timeout='0'.*positive"),
    ("127.0.0.1:2379", {"grow": "sometimes"},
     "grow policy 'sometimes': use immediate, at-failure or interval:MIN"),
    ("127.0.0.1:2379", {"grow": "interval:nan"}, "'interval:nan': MIN in interval:MIN"),
    ("127.0.0.1:2379", {"grow": "interval:-5"}, "'interval:-5': MIN in interval:MIN"),
    ("127.0.0.1:2379", {"grow": "interval:soon"}, "'interval:soon': MIN in interval:MIN"),
    ("127.0.0.1:2379", {"grow": "interval:"}, "'interval:': MIN in interval:MIN"),
    ("127.0.0.1:2379", {"last_call_timeout": "-1"}, "last_call_timeout='-1'"),
    ("127.0.0.1:2379", {"close_on_failure": "perhaps"}, "close_on_failure='perhaps'"),
])
def test_bad_settings_are_refused_and_quoted(endpoint, conf, message, monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    with pytest.raises(ValueError, match=message):
        RendezvousConfig.from_params(params(endpoint, **conf))


def test_bad_run_id_is_refused():
    with pytest.raises(ValueError, match="--rdzv-id"):
        RendezvousConfig.from_params(params(run_id="my job"))


def test_keys_of_torchs_dynamic_rendezvous_are_accepted_ignored_and_logged(caplog):
    # An older command line (or elasticd's former daemon settings) still runs.
    conf = {"keep_alive_interval": "1", "keep_alive_max_attempt": "3", "poll_interval": "0.25",
            "standby_fix": "true", "lease_liveness": "true", "close_last_call": "true"}
    cfg = RendezvousConfig.from_params(params(**conf))
    assert sorted(cfg.ignored) == sorted(conf)
    with caplog.at_level(logging.INFO, logger="elasticd.rendezvous.handler"):
        handler = create_handler(params(**conf), "etcd-v3", coordinator=MemoryCoordinator())
    handler.stop()
    assert "keep_alive_interval" in caplog.text and "ignored" in caplog.text


def test_the_entry_points_register_elasticds_own_handler():
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    eps = {e.name: e for e in entry_points(group="torchrun.handlers")}
    assert eps["etcd-v3"].load() is handler_creator
    assert eps["etcd-v3-native"].load() is native_handler_creator
    for name in ("etcd-v3", "etcd-v3-native"):
        # No etcd needed: building the handler does not talk to it yet.
        handler = rendezvous_handler_registry.create_handler(params(backend=name))
        assert isinstance(handler, EtcdNativeRendezvousHandler)
        assert handler.get_backend() == name
        assert handler.use_agent_store is False
        handler.stop()


def test_the_creator_hands_every_handler_to_the_hooks_and_the_daemons_hook_needs_a_daemon(
        monkeypatch):
    # elasticd.agent.torchrun (how daemons start torchrun) hooks in a node's duties; the
    # rendezvous plugin itself imports no agent code.
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from elasticd.agent import torchrun
    from elasticd.rendezvous import plugin as rendezvous

    watches, commit_watches = [], []

    class RecordingWatch:
        def __init__(self, coordinator, node_key, **kwargs):
            self.coordinator, self.node_key, self.settled = coordinator, node_key, []
            self.kwargs, self.lease = kwargs, None
            watches.append(self)

        def lease_seen(self):
            return self.lease

        def start(self):
            self.started = True

        def settle(self, seconds):
            self.settled.append(seconds)

    class RecordingCommits(RecordingWatch):
        def __init__(self, coordinator, keys, job):
            self.coordinator, self.job = coordinator, job
            commit_watches.append(self)

    monkeypatch.setattr(torchrun, "DaemonWatch", RecordingWatch)
    monkeypatch.setattr(torchrun, "CommitWatch", RecordingCommits)
    monkeypatch.setattr(rendezvous, "on_handler_created", [torchrun.attach])
    for var in ("ELASTICD_NODE", "ELASTICD_SOCKET", "ELASTICD_TAG"):
        monkeypatch.delenv(var, raising=False)
    plain = rendezvous_handler_registry.create_handler(params())
    assert plain.on_round_broken is None and watches == []  # plain torchrun: nothing
    plain.stop()
    monkeypatch.setenv("ELASTICD_NODE", "n1")
    monkeypatch.setenv("ELASTICD_SOCKET", "/nonexistent/elasticd.sock")
    monkeypatch.setenv("ELASTICD_TAG", "/elasticd:n1:job")
    monkeypatch.setenv("ELASTICD_PREFIX", "/p")
    handler = rendezvous_handler_registry.create_handler(params())
    assert handler.on_round_broken.func is torchrun.restart_own_workers
    assert handler.on_round_broken.keywords == {"sock": "/nonexistent/elasticd.sock"}
    [watch] = watches
    assert watch.started and watch.node_key == b"/p/nodes/n1"
    assert watch.coordinator is handler.coordinator
    handler.join_gate()  # settles for up to a lease TTL and a second
    assert watch.settled == [handler.settings.liveness_ttl + 1.0] == [4.0]
    # The gate may skip its ping while the daemon answered within silent_for - ping_timeout:
    # the watch is told the ping's timeout, below silent_for (its default, 1 s).
    assert watch.kwargs["ping_timeout"] == torchrun.PING_TIMEOUT < 1.0
    # The daemon's lease in each join record: the watch's view, no read (the write compares
    # it with the daemon record's, daemon_key); read only when the watch has not seen it.
    assert handler.daemon_key == b"/p/nodes/n1"
    reads = []
    handler.coordinator.get = lambda key: reads.append(key)  # the record is absent
    watch.lease = 0xAB
    assert handler.daemon_of() == ("n1", 0xAB) and reads == []
    watch.lease = None
    assert handler.daemon_of() is None and reads == [b"/p/nodes/n1"]
    assert handler.commit_gate is None and commit_watches == []  # grow=immediate: no gate
    handler.stop()
    # grow=interval:MIN: the handler asks the job's commit gate before a newcomer enters
    # (attach once read a private the handler no longer had, and never gave it one).
    handler = rendezvous_handler_registry.create_handler(params(grow="interval:10"))
    [commits] = commit_watches
    # Lazy: the gate watches etcd only once the handler asks it (a newcomer waiting).
    assert handler.commit_gate is commits and not getattr(commits, "started", False)
    assert (commits.coordinator, commits.job) == (handler.coordinator, "job")
    handler.stop()


def test_the_daemons_grow_setting_reaches_its_agents_rendezvous():
    from elasticd.config import load
    from elasticd.daemon.agent_setup import rdzv_conf

    for grow in ("immediate", "at-failure", "interval:30"):
        settings = load({"rdzv_grow": grow}, None, {})
        conf = rdzv_conf(settings)
        assert RendezvousConfig.from_params(params(**conf)).handler.grow == grow


def test_the_handler_is_given_every_setting_torchrun_passed():
    conf = {"liveness_ttl": "5", "liveness_confirm": "0.5", "join_timeout": "60",
            "last_call_timeout": "2", "read_timeout": "30", "grow": "interval:10",
            "close_on_failure": "false"}
    handler = create_handler(RendezvousParameters("etcd-v3-native", "127.0.0.1:2379", "job", 2,
                                                  4, **conf),
                             "etcd-v3-native", coordinator=MemoryCoordinator())
    handler.stop()
    assert handler.settings == HandlerSettings(
        "job", 2, 4, "etcd-v3-native", liveness_ttl=5, liveness_confirm=0.5, join_timeout=60.0,
        last_call=2.0, store_timeout=datetime.timedelta(seconds=30), grow="interval:10",
        close_on_failure=False)
    assert handler.settings.grow_interval == 600.0
    assert (handler.get_backend(), handler.get_run_id()) == ("etcd-v3-native", "job")


@pytest.mark.parametrize("sizes, grow, message", [
    ((0, 2), "immediate", "--nnodes 0:2: need 1 <= MIN <= MAX"),
    ((3, 2), "immediate", "--nnodes 3:2"),
    ((1, 2), "sometimes", "grow policy 'sometimes'"),
])
def test_bad_sizes_or_grow_policy_are_refused_before_any_handler(sizes, grow, message):
    # (torchrun's own RendezvousParameters refuses bad sizes first, in words of its own.)
    with pytest.raises(ValueError, match=message):
        HandlerSettings("job", *sizes, grow=grow)
