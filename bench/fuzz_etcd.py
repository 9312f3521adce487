"""An etcd fuzz: malformed writes over every key kind the daemons read, while they run a job.

Three daemons run a real 3-node training job with peer replication; this script then writes
(and sometimes deletes) ``--count`` malformed records under every key kind a daemon reads — node
records, job specs of other jobs, the running job's control, node statuses, placement and
checkpoint-commit records, drain requests, events, and keys whose names are no valid node or job
(``jobs/../spec``, ``nodes/n1\\n``, ``nodes/a/b``) — and records what it saw: whether a daemon
exited, every ``/healthz`` answer that was not 200, the job's step before and after, and how many
warnings each daemon logged about bad records (each bad record should cost at most one).

The running job's own spec is not fuzzed here (tests/unit/test_hostile_records.py corrupts it
to see the job refused). Malformed means malformed: a well-formed record that asks for something
(a drain, a stop) is an operator's request, not an attack on the decoder.

Then (``--hostile N``) the job is stopped and N well-formed specs are written whose script is no
job's script: pseudo files (``/proc/self/pagemap``, ``/sys``), devices, FIFOs, symlinks, a
directory, a socket, a 1 TiB sparse file, an empty file, another user's file, and a path that a
thread keeps swapping between a file, a FIFO and symlinks while the daemons check it. Every
daemon must refuse each one (the reasons are counted), with ``/healthz`` answering 200 within
2 s at every poll, and then run a new job.

    .venv/bin/python bench/fuzz_etcd.py --count 10000 --hostile 500 \
        --out bench/results/fuzz_etcd.json

tests/integration/test_etcd_fuzz.py runs the same with a shorter count.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from elasticd.launcher import JOB_USER

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "examples", "train.py")
JOB = "fuzzed"
STEP_RE = re.compile(rb"\bstep (\d+) world (\d+)")
# What daemons log about a record they ignore (daemon, job manager, drainer, commit records).
BAD_RECORD_RE = re.compile(r"ignoring node record|ignoring job record|ignoring the drain record|"
                           r"ignoring a commit record|ignoring the committed record|"
                           r"unreadable committed record")
PER_CYCLE_RE = re.compile(r"ignoring node record|ignoring job record|ignoring the drain record")


def templates(nodes: list[str]) -> dict[str, dict[str, Any]]:
    """A well-formed record of each kind (the fuzz breaks them)."""
    n = nodes[0]
    return {
        "node": {"node": n, "state": "up", "address": "127.0.0.1:1", "hostname": "h",
                 "pid": 1, "incarnation": "x", "started_at": 1.0, "heartbeat_at": 1.0,
                 "version": "0", "lease": 1, "sentence": "", "replication": "127.0.0.1:2"},
        "job_spec": {"name": "j", "nnodes_min": 1, "nnodes_max": 1, "nproc_per_node": 1,
                     "script": TRAIN, "args": [], "script_sha256": "0" * 64, "user": "nobody",
                     "cwd": "/", "env": {}, "python": sys.executable, "max_restarts": 1,
                     "hang_timeout": 1.0, "created_at": 1.0},
        "job_control": {"desired": "running", "at": 1.0, "by": "x"},
        "node_job_status": {"node": n, "state": "running", "detail": "", "agent_pid": 1,
                            "agent_starts": 1, "worker_restarts": 0, "world_size": 3,
                            "last_step": 1, "log": "", "at": 1.0, "ranks": [0]},
        "drain": {"node": n, "state": "requested", "requested_at": 1.0, "by": "x",
                  "timeout": 10.0, "phase": "", "detail": "", "copies_done": 0,
                  "copies_failed": 0, "copies_planned": 0, "updated_at": 1.0, "jobs": {},
                  "log": []},
        "placement": {"nodes": nodes, "ranks": {x: [i] for i, x in enumerate(nodes)}, "m": 2,
                      "requested_m": 2, "strategy": "group", "groups": [nodes],
                      "holders": {x: [x, nodes[(i + 1) % len(nodes)]]
                                  for i, x in enumerate(nodes)}, "round": 1},
        "ckpt_committed": {"generation": 1, "step": 1, "ranks": [0], "holders": {"0": [n]},
                           "m": 2, "round": 1, "at": 1.0},
        "ckpt_coordinator": {"node": n, "term": 7, "at": 1.0},
        "ckpt_ahead": {"version": [1, 2], "at": 1.0},
        "ckpt_fence": {"node": n, "withdrawn": [[1, 1]], "at": 1.0},
        "event": {"kind": "failed", "node": n, "lease": 1, "at": 1.0, "by": n, "detail": "",
                  "data": {}, "instance": ""},
    }


def wrong_for(rng: random.Random, value: Any) -> Any:
    """A value of another JSON type than ``value`` (so the record is malformed for sure, not
    merely odd: an odd but well-formed record is a request, e.g. a drain)."""
    if isinstance(value, bool):
        pool: list[Any] = ["soon", 1, None, [], {}]
    elif isinstance(value, (int, float)):
        pool = ["soon", "1", True, None, [], {"a": 1}, [1, "a"]]
    elif isinstance(value, str):
        pool = [1, 1.5, True, None, [], {}, ["x"]]
    elif isinstance(value, list):
        pool = ["soon", 1, {}, None, [None, {"a": []}]]
    else:
        pool = ["soon", 1, [], None, True]
    return rng.choice(pool)


def malformed(rng: random.Random, kind: str, body: dict[str, Any], other_node: str) -> bytes:
    """One malformed value of ``kind`` (a broken copy of ``body``)."""
    b = dict(body)
    choice = rng.randrange(12)
    if choice == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
    if choice == 1:
        raw = json.dumps({"schema": 1, "record": kind, **b}).encode()
        return raw[: rng.randrange(len(raw))]
    if choice == 2:
        return json.dumps({"schema": 1, "record": "other", **b}).encode()
    if choice == 3:
        return json.dumps({"schema": rng.choice(["1", 1.0, None, 99, True]), "record": kind,
                           **b}).encode()
    if choice == 4:
        field = rng.choice(sorted(k for k, v in b.items() if isinstance(v, (int, float))))
        b[field] = 0.0  # replaced by a non-finite number below
        text = json.dumps({"schema": 1, "record": kind, **b})
        bad = rng.choice(["NaN", "Infinity", "-Infinity"])
        return text.replace(f'"{field}": 0.0', f'"{field}": {bad}', 1).encode()
    if choice == 6:
        return b"[" * rng.choice([10, 5000, 100_000])
    if choice == 8:
        return b""
    if choice == 9:
        return json.dumps([1, 2, 3]).encode()
    if choice == 5:
        del b[rng.choice(sorted(b))]
    elif choice == 7 and ("node" in b or "name" in b):
        b["node" if "node" in b else "name"] = other_node  # names another node / job
    # ... and at least one field of the wrong type (distinct fields: a second wrong value for
    # the same field could be right again).
    for field in rng.sample(sorted(b), min(len(b), rng.randrange(1, 3))):
        b[field] = wrong_for(rng, b[field])
    return json.dumps({"schema": 1, "record": kind, **b}).encode()


def key_for(rng: random.Random, kind: str, prefix: str, nodes: list[str], i: int) -> bytes:
    """A key of ``kind`` the daemons read (never the running job's spec, never a live node's
    own record or job status: those are bound to leases and rewritten only on change)."""
    fz = f"fz{i % 97}"
    odd = rng.choice([fz, f"{nodes[0]}x", f"{nodes[0]}\n", "..", "a/b", "", "é"])
    node = rng.choice([fz, fz, odd])
    j = f"{prefix}/jobs/{JOB}"
    if kind == "node":
        return f"{prefix}/nodes/{node}".encode()
    if kind == "job_spec":
        return f"{prefix}/jobs/{rng.choice([fz, '..', 'x/y', fz + chr(10)])}/spec".encode()
    if kind == "job_control":
        return f"{j}/control".encode()
    if kind == "node_job_status":
        return f"{j}/nodes/{node}".encode()
    if kind == "drain":
        return f"{prefix}/drain/{rng.choice(nodes + [node])}".encode()
    if kind == "placement":
        return f"{j}/placement".encode()
    if kind == "ckpt_committed":
        return f"{j}/ckpt/committed".encode()
    if kind == "ckpt_coordinator":
        return f"{j}/ckpt/committed.coordinator".encode()
    if kind == "ckpt_ahead":
        return f"{j}/ckpt/committed.ahead".encode()
    if kind == "ckpt_fence":
        return f"{j}/ckpt/fence/{node}".encode()
    return f"{prefix}/events/{node}/{rng.randrange(2**32):016x}/failed".encode()


def fuzz(coord: Any, prefix: str, nodes: list[str], count: int, seed: int = 0,
         stop: Callable[[], bool] = lambda: False) -> dict[str, int]:
    """Writes ``count`` malformed records (about one in ten a delete of an earlier key);
    returns the writes per kind."""
    rng = random.Random(seed)
    bodies = templates(nodes)
    kinds = sorted(bodies)
    done: dict[str, int] = {k: 0 for k in kinds}
    written: list[bytes] = []
    for i in range(count):
        if stop():
            break
        kind = kinds[i % len(kinds)]
        if written and rng.random() < 0.1:
            coord.delete(written.pop(rng.randrange(len(written))))
        key = key_for(rng, kind, prefix, nodes, i)
        coord.put(key, malformed(rng, kind, bodies[kind], rng.choice(nodes)))
        written.append(key)
        done[kind] += 1
    return done


class HealthWatch:
    """Polls each daemon's /healthz while the fuzz runs; keeps every answer that is not 200, and
    every poll that took more than 2 s (a stall)."""

    def __init__(self, cluster: Any, interval: float = 0.5) -> None:
        self.cluster, self.interval = cluster, interval
        self.bad: list[str] = []
        self.slow: list[str] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for n in self.cluster.nodes.values():
                code, took = n.healthz(timeout=5.0)
                self.polls += 1
                if code != 200:
                    self.bad.append(f"{n.node_id}: {code}")
                if took > 2.0:
                    self.slow.append(f"{n.node_id}: {took:.1f} s")
            self._stop.wait(self.interval)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def last_step(cluster: Any, job: str = JOB) -> int:
    """The newest step any node's workers logged."""
    best = -1
    for n in cluster.nodes:
        path = os.path.join(cluster.workdir, n, "jobs", job, "agent.log")
        try:
            with open(path, "rb") as fh:
                best = max([best] + [int(m.group(1)) for m in STEP_RE.finditer(fh.read())])
        except FileNotFoundError:
            pass
    return best


def bad_record_lines(cluster: Any, text: bool = False) -> dict[str, Any]:
    """Per node, how many warnings about bad records its log holds (or the lines)."""
    out: dict[str, Any] = {}
    for n in cluster.nodes.values():
        lines = [ln for ln in n.log_text().splitlines() if BAD_RECORD_RE.search(ln)]
        out[n.node_id] = lines if text else len(lines)
    return out


def ctl(cluster: Any, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elasticd.cli.main", *args],
        env={**os.environ, "ELASTICD_ETCD": cluster.etcd, "ELASTICD_PREFIX": cluster.prefix},
        capture_output=True, text=True, timeout=120)


def submit(cluster: Any, user: str = JOB_USER, job: str = JOB) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "elasticd.cli.main", "submit", job, "--nnodes",
         str(len(cluster.nodes)), "--nproc-per-node", "1", "--user", user, "--", TRAIN,
         "--steps", "100000", "--step-time", "0.05"],
        env={**os.environ, "ELASTICD_ETCD": cluster.etcd, "ELASTICD_PREFIX": cluster.prefix},
        capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise RuntimeError(f"submit failed: {res.stderr.strip()}")


def run(cluster: Any, count: int, seed: int = 0, quiet: float = 3.0) -> dict[str, Any]:
    """Fuzzes a started cluster running :data:`JOB`; returns what was seen."""
    names = sorted(cluster.nodes)
    cluster.wait_for(lambda: last_step(cluster) >= 5, 120, "the job training")
    before_step = last_step(cluster)
    started = time.monotonic()
    with HealthWatch(cluster) as health:
        writes = fuzz(cluster.coordinator(), cluster.prefix, names, count, seed,
                      stop=lambda: not all(n.running for n in cluster.nodes.values()))
        fuzz_seconds = time.monotonic() - started
        # Let the daemons take in the last writes (the count stops growing), then a quiet
        # period: nothing more logged (a bad record costs one warning, not one per cycle).
        logged, end = bad_record_lines(cluster), time.monotonic() + 20
        while time.monotonic() < end:
            time.sleep(1.0)
            now = bad_record_lines(cluster)
            if now == logged:
                break
            logged = now
        step_after_fuzz = last_step(cluster)
        cluster.wait_for(lambda: last_step(cluster) > step_after_fuzz, 60, "training goes on")
        time.sleep(quiet)
        lines = bad_record_lines(cluster, text=True)
        logged_after_quiet = {n: len(ls) for n, ls in lines.items()}
        # Records read every cycle (node records, job records, this node's drain record) must
        # log nothing new; commit records are read when the replicator needs them, so a bad
        # one may first be read (and logged, once) late.
        late = {n: [ln for ln in ls[logged[n]:] if PER_CYCLE_RE.search(ln)][:5]
                for n, ls in lines.items()}
        late = {n: ls for n, ls in late.items() if ls}
    return {
        "count": sum(writes.values()),
        "writes_per_kind": writes,
        "fuzz_seconds": round(fuzz_seconds, 2),
        "daemons_exited": sorted(n.node_id for n in cluster.nodes.values() if not n.running),
        "healthz_polls": health.polls,
        "healthz_not_200": health.bad,
        "healthz_over_2s": health.slow,
        "step_before": before_step,
        "step_after_fuzz": step_after_fuzz,
        "step_at_end": last_step(cluster),
        "bad_record_warnings": logged,
        "bad_record_warnings_after_quiet": logged_after_quiet,
        "logged_in_quiet": late,
    }


def hostile_paths(base: str) -> list[str]:
    """Script paths that are no job's script: pseudo files and devices as they are, and special
    files, links and odd files made under ``base`` (which the job's user can reach).
    ``base/swapped.py`` is the path :class:`Swapper` keeps changing."""
    os.makedirs(base, exist_ok=True)

    def at(name: str) -> str:
        return os.path.join(base, name)

    os.mkfifo(at("fifo.py"), 0o644)
    os.symlink(at("fifo.py"), at("link-to-fifo.py"))
    os.symlink("/proc/self/pagemap", at("link-to-pagemap.py"))
    os.symlink("/proc", at("link-to-dir.py"))
    os.mkdir(at("dir.py"), 0o755)
    with open(at("sparse.py"), "wb") as fh:
        fh.truncate(1 << 40)
    open(at("empty.py"), "wb").close()
    with open(at("others.py"), "w") as fh:
        fh.write("print('not yours')\n")
    if os.geteuid() == 0:
        os.chown(at("others.py"), 54321, 54321)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(at("socket.py"))
    for name in ("sparse.py", "empty.py", "others.py", "socket.py"):
        os.chmod(at(name), 0o644)
    made = ["fifo.py", "link-to-fifo.py", "link-to-pagemap.py", "link-to-dir.py", "dir.py",
            "sparse.py", "empty.py", "others.py", "socket.py", "swapped.py"]
    fixed = ["/proc/self/pagemap", "/proc/self/mem", "/proc/kcore", "/proc/1/environ",
             "/sys/kernel/mm/transparent_hugepage/enabled", "/dev/zero", "/dev/urandom",
             "/dev/stdin", "/dev/full", "/etc/shadow"]
    return [p for p in fixed if os.path.lexists(p)] + [at(n) for n in made]


class Swapper:
    """Keeps replacing ``path`` (by an atomic rename, so it always exists) with a regular file, a
    FIFO, a symlink to /proc/self/pagemap and one to the FIFO, as fast as it can: a check of the
    path and a later open of it meet different files."""

    def __init__(self, path: str) -> None:
        self.path, self.swaps = path, 0
        base = os.path.dirname(path)
        self._regular = os.path.join(base, "swap-regular")
        with open(self._regular, "w") as fh:
            fh.write("print('a plain script')\n")
        os.chmod(self._regular, 0o644)
        self._fifo = os.path.join(base, "swap-fifo")
        os.mkfifo(self._fifo, 0o644)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._swap(lambda t: os.link(self._regular, t))

    def _swap(self, make: Callable[[str], None]) -> None:
        tmp = self.path + ".tmp"
        if os.path.lexists(tmp):  # renaming a link onto one of the same file leaves both
            os.unlink(tmp)
        make(tmp)
        os.replace(tmp, self.path)
        self.swaps += 1

    def _run(self) -> None:
        makers = (lambda t: os.link(self._regular, t), lambda t: os.link(self._fifo, t),
                  lambda t: os.symlink("/proc/self/pagemap", t),
                  lambda t: os.symlink(self._fifo, t))
        while not self._stop.is_set():
            for make in makers:
                self._swap(make)

    def __enter__(self) -> "Swapper":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def write_hostile(cluster: Any, paths: list[str], count: int, seed: int, user: str) -> list[str]:
    """Writes ``count`` well-formed specs (as any etcd writer can) whose script is one of
    ``paths``; returns their jobs."""
    from elasticd.cluster.jobspec import JobControl, JobSpec

    rng = random.Random(seed)
    coord, keys = cluster.coordinator(), cluster.keys
    jobs = []
    for i in range(count):
        job = f"hostile{i}"
        spec = JobSpec(name=job, nnodes_min=1, nnodes_max=len(cluster.nodes), nproc_per_node=1,
                       script=paths[i % len(paths)] if i < len(paths) else rng.choice(paths),
                       args=[], script_sha256="0" * 64, user=user, cwd="/",
                       python=sys.executable, created_at=time.time())
        coord.put(keys.job_keys(job).spec, spec.encode())
        coord.put(keys.job_keys(job).control, JobControl("running", time.time(), "fuzz").encode())
        jobs.append(job)
    return jobs


def refusals(cluster: Any, jobs: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Per node, how many of ``jobs`` it refused; and each distinct reason (the path left out)
    with how often it was given."""
    from elasticd.cluster.jobspec import NodeJobStatus
    from elasticd.coordination.records import RecordError

    wanted = set(jobs)
    per_node = {n: 0 for n in cluster.nodes}
    reasons: dict[str, int] = {}
    kvs, _ = cluster.coordinator().get_prefix(cluster.keys.jobs)
    for kv in kvs:
        try:
            job, what, node = cluster.keys.job_key(kv.key)
            st = NodeJobStatus.decode(kv.value) if what == "nodes" and job in wanted else None
        except (ValueError, RecordError):
            continue
        if st is not None and st.state == "refused" and node in per_node:
            per_node[node] += 1
            why = re.sub(r"'[^']*'", "'…'", st.detail)
            reasons[why] = reasons.get(why, 0) + 1
    return per_node, dict(sorted(reasons.items(), key=lambda kv: -kv[1]))


def run_hostile(cluster: Any, count: int, base: str, seed: int = 0, user: str = JOB_USER,
                timeout: float = 900.0) -> dict[str, Any]:
    """Stops :data:`JOB`, writes ``count`` specs with hostile script paths (under ``base``) while
    a :class:`Swapper` runs, waits until every node refused every one, then runs a new job."""
    res = ctl(cluster, "stop", JOB, "--force", "--wait", "120")
    if res.returncode != 0:
        raise RuntimeError(f"stop failed: {res.stderr.strip()}")
    paths = hostile_paths(base)
    started = time.monotonic()
    with HealthWatch(cluster) as health, Swapper(os.path.join(base, "swapped.py")) as swapper:
        jobs = write_hostile(cluster, paths, count, seed, user)
        deadline = time.monotonic() + timeout
        while True:
            per_node, reasons = refusals(cluster, jobs)
            if all(k == len(jobs) for k in per_node.values()) or time.monotonic() > deadline:
                break
            if not all(n.running for n in cluster.nodes.values()):
                break
            time.sleep(2.0)
        seconds = time.monotonic() - started
    after = "after-hostile"
    submit(cluster, user, job=after)
    try:
        cluster.wait_for(lambda: last_step(cluster, after) >= 5, 180, "a new job training")
        trained = True
    except TimeoutError:
        trained = False
    return {
        "count": len(jobs),
        "paths": paths,
        "swaps": swapper.swaps,
        "seconds": round(seconds, 2),
        "refused_per_node": per_node,
        "reasons": reasons,
        "daemons_exited": sorted(n.node_id for n in cluster.nodes.values() if not n.running),
        "healthz_polls": health.polls,
        "healthz_not_200": health.bad,
        "healthz_over_2s": health.slow,
        "new_job_trained": trained,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--count", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hostile", type=int, default=500,
                   help="specs with hostile script paths written after the fuzz (0: none)")
    p.add_argument("--user", default=JOB_USER, help="the job's user (--user of submit; "
                   "default: nobody under root, else yourself)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    from elasticd.launcher import LocalCluster

    cluster = LocalCluster(["n1", "n2", "n3"], workdir=tempfile.mkdtemp(prefix="fuzz-etcd-"),
                           replication=True)
    try:
        cluster.start()
        submit(cluster, args.user)
        result = run(cluster, args.count, args.seed)
        if args.hostile:
            result["hostile_scripts"] = run_hostile(
                cluster, args.hostile, os.path.join(cluster.workdir, "hostile"), args.seed,
                args.user)
    finally:
        cluster.stop()
    result["command"] = " ".join(["bench/fuzz_etcd.py", *sys.argv[1:]])
    print("logs in", cluster.workdir, file=sys.stderr)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    ok = (not result["daemons_exited"] and not result["healthz_not_200"]
          and not result["healthz_over_2s"]
          and result["step_at_end"] > result["step_after_fuzz"] > result["step_before"])
    hostile = result.get("hostile_scripts")
    if hostile:
        ok = ok and (not hostile["daemons_exited"] and not hostile["healthz_not_200"]
                     and not hostile["healthz_over_2s"] and hostile["new_job_trained"]
                     and all(k == hostile["count"] for k in hostile["refused_per_node"].values()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
