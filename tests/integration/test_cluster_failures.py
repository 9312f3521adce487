"""Three real daemons on a real etcd: failure detection, clean departure, etcd outages,
fencing, and what elasticctl shows. Every process is stopped by the test."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from elasticd.launcher import LocalCluster
from elasticd.store.huge_pages import probe

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

TTL = 2


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(["n1", "n2", "n3"], workdir=str(tmp_path), lease_ttl=TTL)
    try:
        yield c.start()
    finally:
        c.stop()


def events_of(cluster, kind, node=None):
    return [e for e in cluster.events() if e["kind"] == kind and (node is None or e["node"] == node)]


def elasticctl(cluster, *args):
    return subprocess.run(
        [sys.executable, "-m", "elasticd.cli.main", *args, "--etcd", cluster.etcd,
         "--prefix", cluster.prefix],
        capture_output=True, text=True, timeout=30)


def test_kill9_is_recorded_as_failure_within_ttl_plus_margin(cluster):
    victim = cluster.nodes["n2"]
    killed_at = time.time()
    victim.kill()
    failed = cluster.wait_for(lambda: events_of(cluster, "failed", "n2"), TTL + 5, "n2 failed")
    latency = failed[0]["at"] - killed_at
    # The product bound is TTL + 1 s; bench/bench_detection.py measures the distribution. The
    # test allows for a loaded CI machine but fails on anything like a missed watch.
    assert latency < TTL + 2.5, latency
    assert failed[0]["by"] in ("n1", "n3")
    assert len(events_of(cluster, "failed")) == 1  # one record, however many observers
    for n in ("n1", "n3"):
        st = cluster.wait_for(
            lambda: (s := cluster.nodes[n].http("/status")) and
            {p["node"] for p in s["peers"]} == {"n1", "n2", "n3"} - {n, "n2"} and s, 5,
            f"{n} sees n2 gone")
        assert st["state"] == "up"
        metrics = cluster.nodes[n].http("/metrics")
        assert "elasticd_nodes_alive 2.0" in metrics
    total = sum(
        float(line.split()[-1]) for n in ("n1", "n3")
        for line in cluster.nodes[n].http("/metrics").splitlines()
        if line.startswith("elasticd_node_failures_detected_total"))
    assert total == 2.0  # each survivor counted it once


def test_clean_shutdown_is_a_departure_not_a_failure(cluster):
    code = cluster.nodes["n3"].terminate()
    assert code == 0
    cluster.wait_for(lambda: events_of(cluster, "left", "n3"), 5, "n3 left")
    cluster.wait_for(lambda: "n3" not in cluster.node_records(), 2, "n3 record gone")
    time.sleep(TTL + 1)  # long enough that a mistaken failure would have been recorded
    assert not events_of(cluster, "failed")
    st = cluster.nodes["n1"].http("/status")
    assert [p["node"] for p in st["peers"]] == ["n2"]
    # What backs the slots, as the daemon found it at start.
    pages = probe(st["shm"]["dir"])
    assert st["shm"] == {"dir": st["shm"]["dir"], "huge_pages": pages.huge_pages,
                         "detail": pages.describe()}


def test_etcd_paused_10s_nobody_fails_everyone_reports_and_rejoins(cluster):
    etcd = cluster.etcd_server.members[0]
    etcd.signal(signal.SIGSTOP)
    try:
        time.sleep(3)
        for n in cluster.nodes.values():
            st = n.http("/status")
            assert st["etcd_up"] is False, st
            assert "etcd unreachable" in st["sentence"]
        time.sleep(7)
    finally:
        etcd.signal(signal.SIGCONT)
    cluster.wait_for(lambda: set(cluster.node_records()) == {"n1", "n2", "n3"}, 10,
                     "all three records back")
    cluster.wait_for(lambda: all(n.http("/status")["etcd_up"] for n in cluster.nodes.values()),
                     5, "all report etcd up")
    # Give provisional expiries their full grace to (wrongly) turn into failures.
    time.sleep(2 * TTL + 3)
    assert not events_of(cluster, "failed"), events_of(cluster, "failed")
    assert not events_of(cluster, "fenced")
    for n in cluster.nodes.values():
        assert n.running
        metrics = n.http("/metrics")
        assert "elasticd_etcd_outages_total 1.0" in metrics
        assert "elasticd_etcd_up 1.0" in metrics
        # Logged once per outage, not once per retry.
        assert n.log_text().count("unreachable:") == 1, n.log_text()
    assert set(cluster.node_records()) == {"n1", "n2", "n3"}


def test_etcd_killed_and_restarted_daemons_rejoin(cluster):
    etcd = cluster.etcd_server.members[0]
    etcd.kill()
    time.sleep(3)
    for n in cluster.nodes.values():
        assert n.running
    etcd.start()
    cluster.etcd_server.wait_healthy()
    cluster.wait_for(lambda: set(cluster.node_records()) == {"n1", "n2", "n3"}, 15,
                     "records present after etcd restart")
    cluster.wait_for(lambda: all(n.http("/status")["etcd_up"] for n in cluster.nodes.values()),
                     5, "all report etcd up")
    assert not events_of(cluster, "failed")


def test_frozen_daemon_is_declared_dead_then_fences_and_rejoins(cluster):
    n2 = cluster.nodes["n2"]
    n2.signal(signal.SIGSTOP)
    try:
        cluster.wait_for(lambda: events_of(cluster, "failed", "n2"), TTL + 5, "n2 failed")
    finally:
        n2.signal(signal.SIGCONT)
    cluster.wait_for(lambda: events_of(cluster, "fenced", "n2"), 10, "n2 fenced itself")
    cluster.wait_for(lambda: cluster.registered("n2"), 10, "n2 registered again")
    st = cluster.wait_for(lambda: (s := n2.http("/status"))["state"] == "up" and s, 5, "n2 up")
    assert "declared dead" in (st["fenced_for"] or "")
    assert "elasticd_fenced_total 1.0" in n2.http("/metrics")


def test_elasticctl_nodes_json_lists_exactly_the_live_daemons(cluster):
    cluster.nodes["n1"].kill()
    cluster.wait_for(lambda: "n1" not in cluster.node_records(), TTL + 5, "n1 expired")
    res = elasticctl(cluster, "nodes", "--format", "json")
    assert res.returncode == 0, res.stderr
    nodes = json.loads(res.stdout)
    assert sorted(n["node"] for n in nodes) == ["n2", "n3"]
    for n in nodes:
        assert n["state"] == "up"
        assert n["address"] == cluster.nodes[n["node"]].address
    pretty = elasticctl(cluster, "status")
    assert pretty.returncode == 0
    assert "2 nodes alive" in pretty.stdout and "failed" in pretty.stdout
    hist = json.loads(elasticctl(cluster, "history", "--format", "json").stdout)
    assert any(e["kind"] == "failed" and e["node"] == "n1" for e in hist)


def test_daemons_stay_small_and_never_import_torch(cluster):
    import psutil

    for n in cluster.nodes.values():
        p = psutil.Process(n.pid)
        rss_mb = p.memory_info().rss / 2**20
        assert rss_mb < 150, rss_mb
        maps = open(f"/proc/{n.pid}/maps").read()
        assert "libtorch" not in maps
