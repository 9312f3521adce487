"""The /metrics endpoint follows Prometheus' rules (promtool on a live scrape), every metric
the code defines is documented in docs/metrics.md's table (and nothing documented is gone),
and the dashboards and alert rules use no metric the code does not define."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from elasticd.metrics import Metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def defined_metric_names() -> set[str]:
    names = set()
    for metric in Metrics().registry.collect():
        name = metric.name
        if metric.type == "counter":
            name += "_total"
        elif metric.type == "info":
            name += "_info"
        names.add(name)
    return names


def documented_metric_names() -> set[str]:
    section = open(os.path.join(REPO, "docs", "metrics.md")).read().split(
        "\n## Dashboards and alerts", 1)[0]
    return {m.group(1) for m in re.finditer(r"^\| `(elasticd_[a-z0-9_]+)", section, re.M)}


def test_every_metric_is_documented_and_vice_versa():
    defined = defined_metric_names()
    documented = documented_metric_names()
    assert defined - documented == set(), "undocumented metrics"
    assert documented - defined == set(), "documented metrics that do not exist"


def used_metric_names(*paths: str) -> dict[str, set[str]]:
    """Metric names in the given files (series suffixes of histograms removed)."""
    out: dict[str, set[str]] = {}
    for path in paths:
        for name in re.findall(r"\belasticd_[a-z0-9_]+", open(os.path.join(REPO, path)).read()):
            out.setdefault(re.sub(r"_(bucket|count|sum)$", "", name), set()).add(path)
    return out


def test_dashboards_and_alert_rules_use_only_defined_metrics():
    used = used_metric_names("grafana/dashboards/elasticd-overview.json",
                             "grafana/dashboards/elasticd-node.json",
                             "grafana/prometheus/elasticd.rules.yml")
    unknown = {n: sorted(p) for n, p in used.items() if n not in defined_metric_names()}
    assert not unknown, f"metrics used but not defined in elasticd/metrics.py: {unknown}"
    assert len(used) > 30  # the pattern found the queries at all


@pytest.mark.etcd
@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (prometheus)")
def test_promtool_accepts_a_live_scrape(tmp_path):
    from elasticd.launcher import LocalCluster

    c = LocalCluster(["m1", "m2"], workdir=str(tmp_path), lease_ttl=2)
    try:
        c.start()
        c.nodes["m2"].kill()
        c.wait_for(lambda: [e for e in c.events() if e["kind"] == "failed"], 10, "failure")
        scrape = c.nodes["m1"].http("/metrics")
    finally:
        c.stop()
    res = subprocess.run(["promtool", "check", "metrics"], input=scrape, capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), (
        res.stdout, res.stderr)
    assert "elasticd_failure_detection_seconds_bucket" in scrape
