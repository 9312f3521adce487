"""etcd's own view of a round at scale, from its /metrics: its apply loop's backlog, its slow
watchers and its disk (what N = 1,000's lease cascade is read against, docs/scale.md).

etcd 3.4 answers a lease renewal only once its apply loop has caught up with the committed
index (up to 1 s, then the renewal fails and its keep-alive stream ends), so the backlog
``proposals_committed_total - proposals_applied_total`` is the first thing a lost lease points
to. Beside it: watchers etcd could not send to at once (``slow_watcher_total``: unsynced and
victims, each read again from the backend under the store's lock), events waiting for them,
applies over 100 ms (``slow_apply_total``), WAL fsyncs and backend commits over 128 ms, leases
etcd expired, and the machine's I/O and CPU stall time (PSI). One scrape every ``period`` seconds (~146 KB of text; ~2 % of a core of etcd at
0.5 s), only the lines named here parsed.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from typing import Any

#: Single-valued metrics kept, by the name used in the samples.
_SCALARS = {
    "etcd_server_proposals_committed_total": "committed",
    "etcd_server_proposals_applied_total": "applied",
    "etcd_server_proposals_pending": "pending_proposals",
    "etcd_debugging_mvcc_slow_watcher_total": "slow_watchers",
    "etcd_debugging_mvcc_pending_events_total": "pending_events",
    "etcd_server_slow_apply_total": "slow_applies",
    "etcd_debugging_server_lease_expired_total": "leases_expired",
}
#: Histograms whose count above :data:`SLOW_BUCKET` seconds is kept.
_HISTOGRAMS = {"etcd_disk_wal_fsync_duration_seconds": "slow_fsyncs",
               "etcd_disk_backend_commit_duration_seconds": "slow_backend_commits"}
SLOW_BUCKET = "0.128"
#: Columns of a sample after its time.
COLUMNS = ("apply_backlog", "pending_proposals", "slow_watchers", "pending_events",
           "slow_applies", "slow_fsyncs", "slow_backend_commits", "leases_expired",
           "io_full_ms", "cpu_some_ms")
#: Of :data:`COLUMNS`, the counters (a sample holds their increase since the one before).
_COUNTERS = {"slow_applies", "slow_fsyncs", "slow_backend_commits", "leases_expired",
             "io_full_ms", "cpu_some_ms"}


def pressure() -> dict[str, float]:
    """The machine's stall time so far, ms (Linux PSI): every task waiting on I/O at once
    (``io_full_ms``: etcd's fsyncs share this VM's disk with other sessions), some task
    waiting for a CPU (``cpu_some_ms``)."""
    out: dict[str, float] = {}
    for name, kind, column in (("io", "full", "io_full_ms"), ("cpu", "some", "cpu_some_ms")):
        try:
            with open(f"/proc/pressure/{name}") as f:
                for line in f:
                    if line.startswith(kind):
                        out[column] = int(line.rsplit("total=", 1)[1]) / 1000
        except OSError:  # no PSI on this kernel: the columns stay 0
            pass
    return out


def read(url: str) -> dict[str, float]:
    """One scrape of ``url``, parsed by :func:`parse`."""
    with urllib.request.urlopen(url, timeout=5) as r:
        return parse(r.read().decode())


def parse(text: str) -> dict[str, float]:
    """etcd's /metrics text: the values of :data:`_SCALARS`, each histogram's count above
    :data:`SLOW_BUCKET`, the apply backlog, and the failed gRPC calls by method and code
    (``failed:<method>:<code>``)."""
    out: dict[str, float] = {}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(("etcd_", "grpc_server_handled_total")):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        if base in _SCALARS:
            out[_SCALARS[base]] = float(value)
        elif base.endswith("_bucket") and base[:-7] in _HISTOGRAMS:
            if f'le="{SLOW_BUCKET}"' in name:
                totals[base[:-7]] = totals.get(base[:-7], 0.0) - float(value)
            elif 'le="+Inf"' in name:
                totals[base[:-7]] = totals.get(base[:-7], 0.0) + float(value)
        elif base == "grpc_server_handled_total" and 'grpc_code="OK"' not in name:
            method = name.split('grpc_method="', 1)[1].split('"', 1)[0]
            code = name.split('grpc_code="', 1)[1].split('"', 1)[0]
            if float(value):
                out[f"failed:{method}:{code}"] = float(value)
    for base, slow in totals.items():
        out[_HISTOGRAMS[base]] = slow
    out["apply_backlog"] = out.get("committed", 0.0) - out.get("applied", 0.0)
    return out


class EtcdProbe:
    """Samples :func:`read` every ``period`` seconds on a thread of its own until :meth:`stop`.

    Args:
        urls: each etcd member's /metrics URL (summed over members).
        period: seconds between scrapes.
    """

    def __init__(self, urls: list[str], period: float = 0.5) -> None:
        self._urls, self._period = urls, period
        self._first = self._read()
        self._samples: list[tuple[float, dict[str, float]]] = [(time.time(), self._first)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-probe", daemon=True)
        self._thread.start()

    def _read(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for url in self._urls:
            try:
                one = read(url)
            except OSError:  # a scrape that failed is a gap in the samples, not an error
                continue
            for k, v in one.items():
                total[k] = total.get(k, 0.0) + v
        return {**total, **pressure()}

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self._samples.append((time.time(), self._read()))

    def stop(self, origin: float, most: int = 40) -> dict[str, Any]:
        """Ends the sampling; the round's view: each column's maximum (counters: their
        increase), failed gRPC calls by method and code, and the samples from ``origin`` (wall
        time), runs of samples merged to at most ``most`` (a gauge's maximum in the run, a
        counter's sum)."""
        self._stop.set()
        self._thread.join()
        self._samples.append((time.time(), self._read()))
        rows = []
        for (_, before), (t, now) in zip(self._samples, self._samples[1:]):
            rows.append([round(t - origin, 2)] + [
                round(now.get(c, 0.0) - before.get(c, 0.0)) if c in _COUNTERS
                else round(now.get(c, 0.0)) for c in COLUMNS])
        last = self._samples[-1][1]
        failed = {k.split(":", 1)[1]: round(v - self._first.get(k, 0.0))
                  for k, v in last.items() if k.startswith("failed:")
                  and v - self._first.get(k, 0.0)}
        peak = {c: max((r[1 + i] for r in rows), default=0) for i, c in enumerate(COLUMNS)
                if c not in _COUNTERS}
        grew = {c: round(last.get(c, 0.0) - self._first.get(c, 0.0)) for c in _COUNTERS}
        k = max(1, -(-len(rows) // most))
        merged = [[run[0][0]] + [sum(r[1 + i] for r in run) if c in _COUNTERS
                                 else max(r[1 + i] for r in run) for i, c in enumerate(COLUMNS)]
                  for run in (rows[i:i + k] for i in range(0, len(rows), k))]
        return {"max": peak, "increase": grew, "failed_calls": failed,
                "columns": ["seconds"] + list(COLUMNS), "samples": merged}
