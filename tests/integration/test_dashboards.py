"""Dashboards and alert rules, checked for real.

The committed dashboard JSON is what grafana/build.py generates; the alert rules pass
`promtool test rules`; and a real Prometheus (Debian's) scrapes a local cluster that trains,
loses a node and recovers, and every panel's query returns data through Prometheus' HTTP API —
the recovery panels a non-zero value."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from elasticd.coordination.embedded import free_port
from elasticd.launcher import JOB_USER, LocalCluster

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "grafana"))
import build as dashboards  # noqa: E402  (grafana/build.py)

TRAIN = os.path.join(REPO, "examples", "train.py")
needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None,
                                      reason="needs Debian's prometheus package")


def test_committed_dashboards_match_the_generator():
    for name, doc in dashboards.build().items():
        with open(os.path.join(REPO, "grafana", "dashboards", name)) as fh:
            assert fh.read() == dashboards.render(doc), f"run: python grafana/build.py ({name})"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool")
def test_alert_rules_pass_promtool():
    d = os.path.join(REPO, "grafana", "prometheus")
    for args in (["check", "rules", "elasticd.rules.yml"],
                 ["test", "rules", "elasticd.rules.test.yml"]):
        res = subprocess.run(["promtool", *args], cwd=d, capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr


def test_every_alert_is_explained_in_the_operations_doc():
    import re

    rules = open(os.path.join(REPO, "grafana", "prometheus", "elasticd.rules.yml")).read()
    tests = open(os.path.join(REPO, "grafana", "prometheus", "elasticd.rules.test.yml")).read()
    doc = open(os.path.join(REPO, "docs", "operations.md")).read()
    alerts = re.findall(r"^\s*- alert: (\w+)", rules, re.M)
    assert len(alerts) >= 10
    section = doc.split("## 9. Alerts", 1)[1]
    missing = [a for a in alerts if f"| `{a}` |" not in section]
    assert not missing, f"alerts without an entry in docs/operations.md: {missing}"
    untested = [a for a in alerts if f"alertname: {a}\n" not in tests]
    assert not untested, f"alerts without a promtool test: {untested}"


def panels():
    for name, doc in dashboards.build().items():
        for p in doc["panels"]:
            for t in p.get("targets", []):
                yield name, p["title"], t["expr"], p.get("elasticd", {}).get("recovery", False)


def test_every_query_uses_an_elasticd_metric():
    for name, title, expr, _ in panels():
        assert "elasticd_" in expr, (name, title)


class Prometheus:
    def __init__(self, workdir, targets):
        self.port = free_port()
        cfg = os.path.join(workdir, "prometheus.yml")
        with open(cfg, "w") as fh:
            fh.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                     "scrape_configs:\n  - job_name: elasticd\n    static_configs:\n"
                     f"      - targets: {json.dumps(targets)}\n")
        self.log = open(os.path.join(workdir, "prometheus.log"), "wb")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={cfg}",
             f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def get(self, path, **params):
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())

    def query(self, expr):
        return self.get("/api/v1/query", query=expr)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def steps_at_world_2(cluster, node):
    path = os.path.join(cluster.workdir, node, "jobs", "job", "agent.log")
    return os.path.exists(path) and " world 2 " in open(path, errors="replace").read()


@needs_prometheus
@pytest.mark.etcd
@pytest.mark.timeout(240)
def test_every_panel_returns_data_from_a_real_prometheus(tmp_path):
    c = LocalCluster(["n1", "n2", "n3"], workdir=str(tmp_path), lease_ttl=2, replication=True)
    prom = None
    try:
        c.start()
        prom = Prometheus(str(tmp_path), [n.address for n in c.nodes.values()])
        c.wait_for(lambda: _ready(prom), 30, "prometheus ready")
        c.wait_for(lambda: len(prom.query("elasticd_nodes_alive")["data"]["result"]) == 3, 30,
                   "prometheus scraping all three daemons")
        env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
        subprocess.run([sys.executable, "-m", "elasticd.cli.main", "submit", "job", "--nnodes",
                        "2:3", "--nproc-per-node", "1", "--user", JOB_USER, "--", TRAIN,
                        "--steps", "100000", "--step-time", "0.05"], env=env, check=True,
                       capture_output=True, timeout=60)
        c.wait_for(lambda: len(prom.query("elasticd_world_size == 3")["data"]["result"]) == 3,
                   90, "world size 3 scraped")
        c.wait_for(lambda: prom.query("min(elasticd_committed_step) > 5")["data"]["result"], 90,
                   "a committed step scraped on every node")
        # The node holding rank 0 dies: after the shrink, new rank 0 needs old rank 0's shard,
        # which only a peer's RAM holds, so the fetch and peer-restore panels show it.
        victim = next(n for n in c.nodes if c.nodes[n].http("/status")["job"]["ranks"] == [0])
        c.nodes[victim].kill()
        survivors = [n for n in c.nodes if n != victim]
        c.wait_for(lambda: all(steps_at_world_2(c, n) for n in survivors), 90,
                   "recovered at world size 2")
        c.wait_for(lambda: prom.query('sum(elasticd_restores_total{source="peer"}) > 0')
                   ["data"]["result"], 30, "a restore from a peer's RAM scraped")
        c.wait_for(lambda: prom.query("max(elasticd_world_size) == 2")["data"]["result"], 30,
                   "world size 2 scraped")
        time.sleep(3)  # a few more scrapes
        empty, zero = [], []
        for name, title, expr, recovery in panels():
            q = (expr.replace("$__rate_interval", "1m").replace("$__range", "10m")
                 .replace("$instance", ".*"))
            res = prom.query(q)
            assert res["status"] == "success", (title, q, res)
            result = res["data"]["result"]
            if not result:
                empty.append((name, title, q))
                continue
            values = [float(r["value"][1]) for r in result]
            if recovery and not any(v > 0 for v in values if v == v):
                zero.append((title, q, values))
        assert not empty, f"panels without data: {empty}"
        assert not zero, f"recovery panels that do not show the recovery: {zero}"
    finally:
        if prom is not None:
            prom.stop()
        c.stop()


def _ready(prom):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{prom.port}/-/ready", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False
