"""Runs every benchmark, each beside its baseline from the same run, and writes the report.

One command for all of bench/: each benchmark script runs as its own process (so a 1 GiB state
or a cluster of daemons is gone before the next one starts) and writes its figures as JSON;
this script collects them into

* ``<out>/latest.json``: every figure with its baselines, units and targets, the machine (CPU
  model, cores, RAM, kernel, Python and torch versions), the git commit and the command line,
  plus each benchmark's raw output;
* ``<out>/latest.md``: the same figures as a Markdown table;
* ``<out>/plots/*.png``: one chart per benchmark (matplotlib, the ``bench`` extra).

On a shared machine pass ``--lock /tmp/elasticd-cpu.lock``: each benchmark then holds the CPU
lock while it runs (and only then), so no benchmark shares the cores with another team's tests
and no one waits for the lock longer than one benchmark. Do not also wrap this command in
``flock`` on the same file: it would wait for itself. The defaults finish in under 10 minutes
on 2 cores (lock waits not counted)::

    python bench/run_all.py --lock /tmp/elasticd-cpu.lock
    python bench/run_all.py --size-mib 256 --runs 1 --only snapshot,replication
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
GIB = 2**30


# -- machine and provenance --------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), cpu)
    ram = None
    with contextlib.suppress(OSError, StopIteration), open("/proc/meminfo") as f:
        ram = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024

    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"cpu_model": cpu, "cores": os.cpu_count(),
            "ram_gib": round(ram / GIB, 1) if ram else None,
            "kernel": platform.release(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": version("torch"),
            "etcd": _first_line(["etcd", "--version"])}


def _first_line(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.splitlines()[0].strip() if out else None


def git_info() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True,
                              timeout=10).stdout.strip()

    # Results written by an earlier run don't make the tree "dirty" for this one.
    dirty = [line for line in git("status", "--porcelain").splitlines()
             if "bench/results/" not in line]
    return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(dirty)}


# -- running the benchmarks --------------------------------------------------------------------


@contextlib.contextmanager
def cpu_lock(path: str | None) -> Iterator[float]:
    """Holds ``path`` with flock (as ``flock(1)`` does) while a benchmark runs; yields the
    seconds spent waiting for it."""
    if not path:
        yield 0.0
        return
    with open(path, "a") as f:
        start = time.monotonic()
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield time.monotonic() - start
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_script(name: str, argv: list[str], out: str, lock: str | None,
               timeout: float) -> dict[str, Any]:
    """Runs ``bench/<name>`` with ``argv`` (which makes it write JSON to ``out``); returns
    that JSON plus how the run went."""
    cmd = [sys.executable, os.path.join(BENCH, name), *argv]
    with cpu_lock(lock) as waited:
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        seconds = time.monotonic() - start
    shown = "bench/" + name + " " + shlex.join(argv)
    print(f"  {shown}: {seconds:.0f} s (waited {waited:.0f} s for the lock), "
          f"exit {proc.returncode}", flush=True)
    if proc.returncode != 0 or not os.path.exists(out):
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{shown} failed (exit {proc.returncode}):\n{tail}")
    with open(out) as f:
        data = json.load(f)
    return {"command": shown, "seconds": round(seconds, 1), "lock_wait_seconds": round(waited, 1),
            "stdout": proc.stdout[-4000:], "data": data}


def figure(benchmark: str, name: str, value: float | None, unit: str,
           baselines: list[tuple[str, float | None]], better: str = "higher",
           target: str | None = None, note: str | None = None) -> dict[str, Any]:
    """One measured figure with its baselines (same unit, same run). ``better`` says which
    direction is good; each baseline's ``ratio`` is value / baseline."""
    def r(x: float | None) -> float | None:
        return None if x is None else float(f"{x:.4g}")

    return {"benchmark": benchmark, "figure": name, "value": r(value), "unit": unit,
            "better": better, "target": target, "note": note,
            "baselines": [{"name": b, "value": r(v),
                           "ratio": r(value / v) if value is not None and v else None}
                          for b, v in baselines]}


# -- one function per benchmark: run it, turn its JSON into figures ----------------------------


def bench_snapshot(a: argparse.Namespace, tmp: str) -> tuple[dict, list[dict]]:
    out = os.path.join(tmp, "snapshot.json")
    raw = run_script("bench_snapshot.py", ["--size-mib", str(a.size_mib), "--tensors",
                                           str(a.tensors), "--repeat", str(a.repeat),
                                           "--json", out], out, a.lock, 600)
    d = raw["data"]
    gbs = {k: d["state_bytes"] / v / 1e9 for k, v in d["seconds"].items()}
    memcpy = gbs["memcpy (numpy, pre-touched)"]
    return raw, [
        figure("snapshot", f"snapshot copy (training-visible), {d['state_bytes'] / GIB:.2f} GiB "
               f"in {d['tensors']} tensors", gbs["elasticd stall (flatten+copy)"], "GB/s",
               [("memcpy into pre-touched memory", memcpy),
                ("torch.save + fsync to /tmp", gbs["torch.save+fsync"])],
               target=">= 80% of memcpy"),
        figure("snapshot", "snapshot seal (xxh3 + header, daemon side, off the training path)",
               gbs["elasticd seal (xxh3+header)"], "GB/s",
               [("memcpy into pre-touched memory", memcpy)]),
    ]


def bench_checkpoint(a: argparse.Namespace, tmp: str) -> tuple[dict, list[dict]]:
    out = os.path.join(tmp, "checkpoint.json")
    raw = run_script("bench_checkpoint.py", ["--steps", str(a.steps), "--rounds",
                                             str(a.rounds), "--replicate", "--json", out],
                     out, a.lock, 600)
    d = raw["data"]
    m = d["modes"]
    job = (f"MLP {d['layers']} x Linear({d['width']}), Adam, batch {d['batch']}, "
           f"{d['threads']} thread; {d['state_bytes'] / 2**20:.0f} MiB state in "
           f"{d['tensors']} tensors; {d['steps_per_mode']} steps per mode")
    off_ms = m["off"]["step_seconds_mean"] * 1e3
    figs = [
        figure("checkpoint", "step time, snapshot every step (overlapped copy)",
               m["overlap"]["step_seconds_mean"] * 1e3, "ms",
               [("no checkpointing", off_ms)], better="lower", target="<= +3% of no checkpoint",
               note=job),
        figure("checkpoint", "step time, snapshot every step + replication to a peer (m=2)",
               m["replicated"]["step_seconds_mean"] * 1e3, "ms",
               [("no checkpointing", off_ms)], better="lower", target="<= +3% of no checkpoint"),
        figure("checkpoint", "training-visible stall per snapshot (overlapped)",
               m["overlap"]["stall_seconds_per_snapshot"] * 1e3, "ms",
               [("the same copy done inside save (not overlapped)",
                 m["sync"]["stall_seconds_per_snapshot"] * 1e3),
                ("memcpy of the state into pre-touched memory", d["memcpy_seconds"] * 1e3)],
               better="lower"),
        figure("checkpoint", "training-visible stall per snapshot, with replication",
               m["replicated"]["stall_seconds_per_snapshot"] * 1e3, "ms",
               [("overlapped, no replication", m["overlap"]["stall_seconds_per_snapshot"] * 1e3)],
               better="lower"),
    ]
    rep = d.get("replication") or {}
    if rep.get("cpu_seconds_per_gib_replicated") is not None:
        figs.append(figure(
            "checkpoint", "daemon CPU per GiB replicated (owner push + peer receive)",
            rep["cpu_seconds_per_gib_replicated"], "CPU s/GiB",
            [("daemon CPU per GiB snapshotted, no replication (seal)",
              d["daemon_cpu_seconds_per_gib_snapshotted"])], better="lower",
            note=f"{rep.get('pushes')} pushes, {rep.get('skipped')} skipped, "
                 f"{rep.get('commits')} commits"))
    return raw, figs


def bench_replication(a: argparse.Namespace, tmp: str) -> tuple[dict, list[dict]]:
    out = os.path.join(tmp, "replication.json")
    raw = run_script("bench_replication.py", ["--mib", str(a.size_mib), "--repeat",
                                              str(a.repeat), "--json", out], out, a.lock, 600)
    v = raw["data"]["variants"]
    e, r, x = v["elasticd push"], v["raw socket"], v["raw + xxh3 per chunk"]
    g, old = v["raw + Poly1305 per chunk"], v["raw + GMAC per chunk (v2)"]
    inline = v["elasticd push, tagged inline"]
    return raw, [
        figure("replication", f"replication throughput, loopback, {a.size_mib} MiB in 4 MiB "
               "chunks (every frame authenticated; blocks carry ChaCha20-Poly1305 tags made at "
               "seal time, protocol v4)", e["gb_per_s"], "GB/s",
               [("raw socket, recv_into a preallocated buffer", r["gb_per_s"]),
                ("elasticd push with every frame tagged on the way (protocol v3)",
                 inline["gb_per_s"]),
                ("raw socket + xxh3 per chunk", x["gb_per_s"]),
                ("raw socket + Poly1305 per chunk, inline", g["gb_per_s"]),
                ("raw socket + AES-GMAC per chunk (protocol v2's tag), inline",
                 old["gb_per_s"])],
               target=">= 80% of raw socket"),
        figure("replication", "CPU per GiB replicated (sender + receiver; the seal's block "
               f"tags, {raw['data']['seal_block_tags_cpu_seconds_per_gib']:.2f} s/GiB once per "
               "snapshot, not included)",
               e["cpu_seconds_per_gib"], "CPU s/GiB",
               [("raw socket", r["cpu_seconds_per_gib"]),
                ("elasticd push, tagged on the way (v3)", inline["cpu_seconds_per_gib"]),
                ("raw socket + xxh3", x["cpu_seconds_per_gib"]),
                ("raw socket + Poly1305, inline", g["cpu_seconds_per_gib"]),
                ("raw socket + AES-GMAC (v2), inline", old["cpu_seconds_per_gib"])],
               better="lower"),
    ]


def bench_peer_restore(a: argparse.Namespace, tmp: str) -> tuple[dict, list[dict]]:
    out = os.path.join(tmp, "peer_restore.json")
    raw = run_script("bench_peer_restore.py", ["--mib", str(a.size_mib), "--tensors",
                                               str(a.tensors), "--repeat", str(a.repeat),
                                               "--out", out], out, a.lock, 600)
    res = raw["data"]["results"]

    def s(prefix: str) -> float:
        return next(v["seconds"] for k, v in res.items() if k.startswith(prefix))

    return raw, [figure(
        "peer_restore", f"restore {a.size_mib} MiB from a peer's RAM (verified)",
        s("elasticd fetch"), "s",
        [("raw socket, 4 MiB recv_into", s("raw socket")),
         ("torch.load from disk, page cache warm", s("torch.load, page cache warm")),
         ("torch.load from disk, cold", s("torch.load, cold"))], better="lower")]


def bench_detection(a: argparse.Namespace, tmp: str) -> tuple[dict, list[dict]]:
    runs, figs = {}, []
    for ttl in a.ttls:
        out = os.path.join(tmp, f"detection-{ttl}.json")
        raw = run_script("bench_detection.py", ["--runs", str(a.runs), "--ttl", str(ttl),
                                                "--nodes", str(a.nodes), "--out", out],
                         out, a.lock, 60 + a.runs * (ttl + 40))
        runs[str(ttl)] = raw
        d = raw["data"]
        figs.append(figure("detection", f"failure detection latency, lease TTL {ttl} s "
                           f"(median of {d['runs']}, worst {d['worst_seconds']} s)",
                           d["median_seconds"], "s", [("lease TTL", ttl)], better="lower",
                           target=f"<= TTL + 1 s ({ttl + 1} s)"))
    return {"by_ttl": runs}, figs


def bench_recovery(a: argparse.Namespace, tmp: str) -> tuple[dict, list[dict]]:
    out = os.path.join(tmp, "recovery.json")
    raw = run_script("bench_recovery.py", ["--runs", str(a.recovery_runs), "--baseline-runs",
                                           str(a.recovery_runs), "--nodes", str(a.nodes),
                                           "--disk-every", str(a.disk_every), "--out", out],
                     out, a.lock, 120 + a.recovery_runs * 2 * 200)
    d = raw["data"]
    e, t = d["elasticd"], d["baseline_plain_torchrun_tuned"]
    base = f"plain torchrun (c10d, tuned, store sharing off), torch.save every {a.disk_every} steps"
    return raw, [
        figure("recovery", f"kill -9 of one of {a.nodes} nodes to training resumed (median of "
               f"recovered runs; recovered: elasticd {e['recovered']}/{e['runs']}, torchrun "
               f"{t['recovered']}/{t['runs']}, which dies with its c10d store host n1)",
               e["median_seconds"], "s", [(base, t["median_seconds"])], better="lower"),
        figure("recovery", "steps lost at the kill (median; elasticd: replicated RAM snapshot "
               "every step)", e["median_steps_lost"], "steps", [(base, t["median_steps_lost"])],
               better="lower", target="<= 1 (the sync lag)"),
    ]


def bench_idle(a: argparse.Namespace, tmp: str) -> tuple[dict, list[dict]]:
    out = os.path.join(tmp, "idle.json")
    raw = run_script("bench_idle.py", ["--seconds", str(a.idle_seconds), "--nodes",
                                       str(a.nodes), "--out", out], out, a.lock, 300)
    d = raw["data"]
    b = d["baselines"]
    return raw, [
        figure("idle", "idle daemon RSS (max over daemons)", d["daemon_rss_mib_max"], "MiB",
               [("etcd", b["etcd"]["rss_mib"]),
                ("bare Python interpreter", b["bare_python_interpreter"]["rss_mib"])],
               better="lower", target=f"<= {d['targets']['rss_mib']} MiB"),
        figure("idle", f"idle daemon CPU over {d['window_seconds']:.0f} s (max over daemons)",
               d["daemon_cpu_percent_max"], "% of a core",
               [("etcd", b["etcd"]["cpu_percent_of_core"])], better="lower",
               target=f"<= {d['targets']['cpu_percent_of_core']}%"),
    ]


BENCHMARKS: dict[str, Callable[[argparse.Namespace, str], tuple[dict, list[dict]]]] = {
    "snapshot": bench_snapshot,
    "checkpoint": bench_checkpoint,
    "replication": bench_replication,
    "peer_restore": bench_peer_restore,
    "detection": bench_detection,
    "recovery": bench_recovery,
    "idle": bench_idle,
}


# -- the report --------------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def markdown(report: dict[str, Any]) -> str:
    m, g = report["machine"], report["git"]
    lines = [
        "# Benchmarks: elasticd beside its baselines (same run)", "",
        f"Measured {report['finished']} in {report['wall_seconds']:.0f} s "
        f"(CPU-lock waits excluded: {report['lock_wait_seconds']:.0f} s) on {m['cpu_model']}, "
        f"{m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}, Python {m['python']}, "
        f"torch {m['torch']}, {m['etcd'] or 'etcd ?'}; commit `{g['commit'][:12]}`"
        f"{' (with uncommitted changes)' if g['dirty'] else ''}.", "",
        f"Command: `{report['command']}`", "",
        "Ratio = figure / baseline. \"Better\" says which way is good.", "",
        "| benchmark | figure | value | unit | better | baseline | baseline value | ratio | target |",
        "| --- | --- | ---: | --- | --- | --- | ---: | ---: | --- |",
    ]
    for f in report["figures"]:
        bs = f["baselines"] or [{"name": "—", "value": None, "ratio": None}]
        for i, b in enumerate(bs):
            head = ([f["benchmark"], f["figure"], _fmt(f["value"]), f["unit"], f["better"]]
                    if i == 0 else ["", "", "", "", ""])
            ratio = "—" if b["ratio"] is None else f"{b['ratio']:.2f}"
            lines.append("| " + " | ".join(head + [b["name"], _fmt(b["value"]), ratio,
                                                    (f["target"] or "") if i == 0 else ""])
                         + " |")
    notes = [f for f in report["figures"] if f.get("note")]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {f['figure']}: {f['note']}" for f in notes]
    if report["failed"]:
        lines += ["", "Failed benchmarks:", ""] + [f"- {k}: {v.splitlines()[0]}"
                                                   for k, v in report["failed"].items()]
    lines += ["", "Plots: " + ", ".join(f"[{os.path.basename(p)}](plots/{os.path.basename(p)})"
                                         for p in report["plots"]), ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], plot_dir: str) -> list[str]:
    """One horizontal bar chart per benchmark: each figure's value beside its baselines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plot_dir, exist_ok=True)
    paths = []
    by_bench: dict[str, list[dict]] = {}
    for f in report["figures"]:
        by_bench.setdefault(f["benchmark"], []).append(f)
    for bench, figs in by_bench.items():
        figs = [f for f in figs if f["value"] is not None]
        if not figs:
            continue
        fig, axes = plt.subplots(len(figs), 1, figsize=(9, 1.2 + 1.0 * sum(
            1 + len(f["baselines"]) for f in figs) / len(figs) * len(figs) ** 0.5 + 0.6),
            squeeze=False)
        for ax, f in zip(axes[:, 0], figs):
            names = ["elasticd"] + [b["name"] for b in f["baselines"]]
            vals = [f["value"]] + [b["value"] or 0 for b in f["baselines"]]
            colors = ["#1f77b4"] + ["#bbbbbb"] * len(f["baselines"])
            y = list(range(len(names)))[::-1]
            ax.barh(y, vals, color=colors)
            ax.set_yticks(y, [_wrap(n, 38) for n in names], fontsize=8)
            for yi, v in zip(y, vals):
                ax.text(v, yi, f" {_fmt(v)}", va="center", fontsize=8)
            ax.set_xlim(0, max(vals) * 1.25 or 1)
            ax.set_title(_wrap(f"{f['figure']} ({f['unit']}, {f['better']} is better)", 90),
                         fontsize=9, loc="left")
            ax.tick_params(axis="x", labelsize=8)
        fig.tight_layout()
        path = os.path.join(plot_dir, f"{bench}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    det = report["raw"].get("detection", {}).get("by_ttl")
    if det:  # latency against the TTL it cannot beat
        fig, ax = plt.subplots(figsize=(6, 4))
        ttls = sorted(int(t) for t in det)
        for t in ttls:
            lat = det[str(t)]["data"]["latencies_seconds"]
            ax.scatter([t] * len(lat), lat, color="#1f77b4", alpha=0.6, s=18)
            ax.plot([t - 0.2, t + 0.2], [statistics.median(lat)] * 2, color="#1f77b4")
        ax.plot([0, max(ttls) + 1], [0, max(ttls) + 1], "--", color="#888", label="= lease TTL")
        ax.plot([0, max(ttls) + 1], [1, max(ttls) + 2], ":", color="#c44", label="TTL + 1 s")
        ax.set_xlabel("lease TTL (s)")
        ax.set_ylabel("kill -9 to failure recorded (s)")
        ax.set_title("Failure detection latency vs lease TTL (dots: runs; bar: median)",
                     fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(plot_dir, "detection_vs_ttl.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--size-mib", type=int, default=1024,
                   help="state size for snapshot, replication and restore (MiB)")
    p.add_argument("--tensors", type=int, default=300, help="tensors holding that state")
    p.add_argument("--repeat", type=int, default=3,
                   help="repetitions per variant of the bandwidth benchmarks (median)")
    p.add_argument("--nodes", type=int, default=3,
                   help="nodes in the recovery, detection and idle clusters (>= 2)")
    p.add_argument("--runs", type=int, default=3, help="kill runs per lease TTL (detection)")
    p.add_argument("--recovery-runs", type=int, default=3,
                   help="kill runs per system (recovery); victims rotate n1, n2, ... and n1 "
                        "hosts plain torchrun's c10d store")
    p.add_argument("--ttls", default="2,4", help="lease TTLs for the detection benchmark (s)")
    p.add_argument("--steps", type=int, default=10,
                   help="training steps per block in the checkpoint benchmark")
    p.add_argument("--rounds", type=int, default=4, help="interleaved blocks per mode")
    p.add_argument("--disk-every", type=int, default=10,
                   help="the recovery baseline's torch.save interval (steps)")
    p.add_argument("--idle-seconds", type=float, default=20, help="idle measurement window")
    p.add_argument("--only", default="", help="comma-separated subset of: " + ",".join(BENCHMARKS))
    p.add_argument("--lock", default=None, help="flock this file around each benchmark")
    p.add_argument("--out-dir", default=os.path.join(BENCH, "results"))
    a = p.parse_args(argv)
    try:
        a.ttls = [int(t) for t in a.ttls.split(",") if t]
    except ValueError:
        p.error(f"--ttls takes whole seconds separated by commas, e.g. 2,4; got {a.ttls!r}")
    chosen = [x for x in a.only.split(",") if x] or list(BENCHMARKS)
    unknown = [x for x in chosen if x not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    if a.nodes < 2 or a.runs < 1 or a.recovery_runs < 1 or a.repeat < 1 or a.size_mib < 1 or not a.ttls:
        p.error("need --nodes >= 2, --runs >= 1, --repeat >= 1, --size-mib >= 1, some --ttls")

    command = "python " + shlex.join([os.path.relpath(os.path.abspath(sys.argv[0]), REPO)]
                                     + (sys.argv[1:] if argv is None else argv))
    report: dict[str, Any] = {
        "command": command, "started": _now(), "machine": machine_info(), "git": git_info(),
        "parameters": {k: v for k, v in vars(a).items() if k not in ("out_dir",)},
        "figures": [], "raw": {}, "failed": {}}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="elasticd-bench-all-") as tmp:
        for name in chosen:
            print(f"{name}:", flush=True)
            try:
                raw, figs = BENCHMARKS[name](a, tmp)
            except (RuntimeError, subprocess.TimeoutExpired, KeyError) as exc:
                report["failed"][name] = f"{type(exc).__name__}: {exc}"
                print(f"  FAILED: {exc}", flush=True)
                continue
            report["raw"][name] = raw
            report["figures"] += figs
    report["finished"] = _now()
    report["lock_wait_seconds"] = sum(_lock_waits(r) for r in report["raw"].values())
    report["wall_seconds"] = time.monotonic() - start - report["lock_wait_seconds"]
    os.makedirs(a.out_dir, exist_ok=True)
    report["plots"] = [os.path.relpath(x, a.out_dir)
                       for x in plot(report, os.path.join(a.out_dir, "plots"))]
    with open(os.path.join(a.out_dir, "latest.json"), "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    with open(os.path.join(a.out_dir, "latest.md"), "w") as f:
        f.write(markdown(report))
    print(markdown(report))
    return 1 if report["failed"] else 0


def _lock_waits(raw: dict[str, Any]) -> float:
    if "lock_wait_seconds" in raw:
        return raw["lock_wait_seconds"]
    return sum(_lock_waits(v) for v in raw.get("by_ttl", {}).values())


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


if __name__ == "__main__":
    sys.exit(main())
