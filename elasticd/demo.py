"""The local demo: an embedded etcd and four daemons on this host. Three train the example job
at world size 3 with a snapshot every step, each replicated to a peer's RAM; the fourth joins as
a spare. One training node is killed with SIGKILL (its RAM with it); the spare takes its place,
so the dead node's rank is restored from a copy in a peer's RAM, the survivors' ranks from their
own. It says where each rank's state came from, prints the recovery's timeline as
``elasticctl history`` and ``/status`` show it beside its own measures of the same moments, ends
by itself and cleans up.

Run it with ``python -m elasticd.demo`` (README: the first set-up command does this for you).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from elasticd.cli.main import EVENT_TABLE, NODE_TABLE, TIMELINE_TABLE, event_rows
from elasticd.cli.main import rank_sources, timeline_rows
from elasticd.clock import SYSTEM_CLOCK, format_local
from elasticd.cluster import timeline
from elasticd.launcher import JOB_USER, LocalCluster

TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                     "train.py")
STEP_RE = re.compile(r"step (\d+) world (\d+) rank (\d+)")
WORLD = 3
JOB = "demo"
SOURCES = {"local": "its own node's RAM", "peer": "a peer's RAM", "persistent": "disk"}


class Demo:
    def __init__(self, cluster: LocalCluster) -> None:
        self.c = cluster
        self.t0 = SYSTEM_CLOCK.monotonic()

    def say(self, text: str) -> None:
        print(f"[{SYSTEM_CLOCK.monotonic() - self.t0:6.2f} s] {text}", flush=True)

    def log(self, node: str) -> str:
        p = os.path.join(self.c.workdir, node, "jobs", JOB, "agent.log")
        return open(p, errors="replace").read() if os.path.exists(p) else ""

    def steps(self, node: str, mark: int | None = None) -> list[int]:
        """Steps trained at world size 3; with ``mark`` (a log offset), by a worker started
        after it."""
        text = self.log(node)
        start = 0 if mark is None else text.find("start rank", mark)
        return [] if start < 0 else [int(m.group(1)) for m in STEP_RE.finditer(text, start)
                                     if int(m.group(2)) == WORLD]

    def rows(self) -> list[dict]:
        now = SYSTEM_CLOCK.wall()
        return [{**r, "heartbeat_age_seconds": round(now - r["heartbeat_at"], 1)}
                for r in self.c.node_records().values()]

    def agents_joined(self) -> int:
        """Agents with a join record in the job's rendezvous (the spare's included)."""
        prefix = self.c.keys.rendezvous(JOB).prefix
        kvs, _ = self.c.coordinator().get_prefix(prefix + b"native/nodes/")
        return len(kvs)

    def events(self, since: float) -> list[dict[str, Any]]:
        """The events as ``elasticctl history`` shows them (the same rows), since ``since``."""
        return [r for r in event_rows(self.c.coordinator(), self.c.keys, 0) if r["at"] >= since]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elasticd.demo", description=__doc__)
    p.add_argument("--lease-ttl", type=int, default=2)
    p.add_argument("--victim", default="n2", help="the training node to kill (n1, n2 or n3)")
    p.add_argument("--kill-at-step", type=int, default=60)
    p.add_argument("--keep", action="store_true", help="keep the logs (default: delete them)")
    args = p.parse_args(argv)
    if not os.path.exists(TRAIN):
        print(f"demo: {TRAIN} is missing: run the demo from a checkout of elasticd",
              file=sys.stderr)
        return 2
    if args.victim not in ("n1", "n2", "n3"):
        p.error("--victim: one of n1, n2, n3 (n4 is the spare)")

    workdir = tempfile.mkdtemp(prefix="elasticd-demo-")
    cluster = LocalCluster(["n1", "n2", "n3"], workdir=workdir, lease_ttl=args.lease_ttl,
                           replication=True)
    d = Demo(cluster)
    try:
        code = run(d, args, workdir)
        if code:
            args.keep = True
        return code
    finally:
        cluster.stop()
        if args.keep:
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        d.say("done: every daemon, worker and etcd stopped")


def run(d: Demo, args: argparse.Namespace, workdir: str) -> int:
    c = d.c
    d.say(f"starting etcd and 3 daemons (lease TTL {args.lease_ttl} s, each snapshot "
          f"replicated to 1 peer); logs in {workdir}")
    c.start()
    env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
    subprocess.run([sys.executable, "-m", "elasticd.cli.main", "submit", JOB, "--nnodes",
                    f"{WORLD}:{WORLD}", "--nproc-per-node", "1", "--user", JOB_USER, "--",
                    TRAIN, "--steps", "100000", "--step-time", "0.02"],
                   env=env, check=True, capture_output=True, timeout=60)
    d.say(f"submitted job '{JOB}' (examples/train.py: DDP over gloo, one worker per node, "
          f"--nnodes {WORLD}:{WORLD}, a snapshot every step)")
    c.wait_for(lambda: all(d.steps(n) for n in ("n1", "n2", "n3")), 180,
               f"training at world size {WORLD}")
    d.say(f"training at world size {WORLD}; starting n4, which joins as a spare (the job "
          f"wants exactly {WORLD} nodes)")
    c.start_node("n4")
    c.wait_for(lambda: d.agents_joined() > WORLD, 60, "n4's agent waiting as a spare")
    print(NODE_TABLE.render(d.rows()), flush=True)
    c.wait_for(lambda: max(d.steps("n1") or [0]) >= args.kill_at_step, 300,
               f"step {args.kill_at_step}")
    status = c.nodes[args.victim].http("/status")
    ranks = (status.get("job") or {}).get("ranks") or []
    survivors = [n for n in ("n1", "n2", "n3") if n != args.victim]
    marks = {n: len(d.log(n)) for n in [*survivors, "n4"]}
    at_step = max(d.steps(args.victim) or [0])
    d.say(f"kill -9 {args.victim} (rank {','.join(map(str, ranks)) or '?'}): its daemon, "
          f"agent and worker, and its RAM with its snapshots and the copies it held for its "
          f"peers; it had trained step {at_step}")
    killed, killed_wall = SYSTEM_CLOCK.monotonic(), SYSTEM_CLOCK.wall()
    c.nodes[args.victim].kill()
    seen = follow(d, args.victim, [*survivors, "n4"], marks, killed, killed_wall)
    if seen is None:
        return 1
    SYSTEM_CLOCK.sleep(1.0)  # a few more steps, and every node's loop past the first step
    report(d, args.victim, seen, killed, killed_wall)
    print(f"\nmetrics: http://{c.nodes[survivors[0]].address}/metrics "
          f"(elasticd_restores_total, elasticd_recovery_phase_seconds, ...); while it runs, "
          f"ELASTICD_ETCD={c.etcd} elasticctl history shows the same events")
    return 0


def follow(d: Demo, victim: str, nodes: list[str], marks: dict[str, int], killed: float,
           killed_wall: float) -> dict[str, Any] | None:
    """Narrates the recovery as it happens; returns what the demo saw itself (monotonic
    times), or None when it did not recover within 120 s."""
    seen: dict[str, Any] = {"first_step": {}, "restored": set()}
    deadline = SYSTEM_CLOCK.monotonic() + 120
    while SYSTEM_CLOCK.monotonic() < deadline:
        rows = d.events(killed_wall)
        for r in rows:
            if r["kind"] == "failed" and r["node"] == victim and "failed" not in seen:
                seen["failed"] = killed + (r["at"] - killed_wall)
                d.say(f"{victim}'s failure recorded in etcd {seen['failed'] - killed:.2f} s "
                      "after the kill (its lease expired)")
            key = (r["node"], r["rank"])
            if r["kind"] == "recovered" and r["job"] == JOB and key not in seen["restored"]:
                seen["restored"].add(key)
                d.say(f"{r['node']}: rank {r['rank']} restored step {r['step']} from "
                      f"{SOURCES.get(r['source'], r['source'])} in "
                      f"{r['restore_seconds'] * 1000:.0f} ms, {r['steps_lost']} steps lost")
        for n in nodes:
            new = d.steps(n, marks[n])
            if n not in seen["first_step"] and new:
                seen["first_step"][n] = SYSTEM_CLOCK.monotonic()
                d.say(f"{n}: training again at world size {WORLD}, "
                      f"{seen['first_step'][n] - killed:.2f} s after the kill, from step "
                      f"{new[0]}")
        if ("failed" in seen and len(seen["first_step"]) == len(nodes)
                and any(r["kind"] == timeline.KIND for r in rows)):
            return seen
        SYSTEM_CLOCK.sleep(0.05)
    missing = [w for w, ok in (("the failure recorded", "failed" in seen),
                               ("every node training again", len(seen["first_step"]) == len(nodes)),
                               ("the recovery's timeline", False)) if not ok]
    d.say(f"not seen within 120 s: {', '.join(missing)}: see the logs")
    return None


def report(d: Demo, victim: str, seen: dict[str, Any], killed: float,
           killed_wall: float) -> None:
    """Where each rank's state came from, the events and the timeline as ``elasticctl
    history`` shows them, and the same recovery measured three ways."""
    rows = d.events(killed_wall - 1.0)
    shown = [r for r in rows if r["kind"] in ("failed", "joined", "recovered", timeline.KIND)]
    print("\nwhere each rank's state came from:\n" + "\n".join(rank_sources(rows)))
    print("\nevents (elasticctl history):\n" + EVENT_TABLE.render(
        [{**r, "at_iso": format_local(r["at"], "%H:%M:%S")} for r in shown]))
    print("\nrecovery timeline (seconds per phase, from the failure to the first step):\n"
          + TIMELINE_TABLE.render(timeline_rows(rows)))
    event = next(r for r in rows if r["kind"] == timeline.KIND)
    t = event["timeline"]
    failed = next(r for r in rows if r["kind"] == "failed" and r["node"] == victim)
    writer = event["by"]
    status = (d.c.nodes[writer].http("/status").get("last_recovery") or {})
    before = killed_wall - t["marks"]["failure"]
    when = (f"{abs(before):.2f} s {'before' if before >= 0 else 'after'} the kill"
            if round(before, 2) else "at the kill")
    print(f"\none recovery, three views: the demo counts from its kill; elasticctl history and "
          f"{writer}'s /status from the failure, placed at {victim}'s last sign of life "
          f"({t['failure_evidence']}: {when})")
    trained = seen["first_step"].get(writer, min(seen["first_step"].values()))
    print(f"  failure recorded:  demo {seen['failed'] - killed:.2f}  "
          f"history {failed['detection_seconds']:.2f}  status "
          f"{_num(status.get('phases', {}).get('detect'))}")
    print(f"  training again:    demo {trained - killed:.2f}  history "
          f"{_num(t['total_seconds'])}  status {_num(status.get('total_seconds'))}   "
          f"(on {writer}, which wrote the timeline)")
    phases = " + ".join(f"{p} {_num(s)}" for p, s in t["phases"].items())
    print(f"  phases (history):  {phases} = {_num(t['total_seconds'])}")
    if "detected" in t["overlapped"]:
        print("  (overlapped: training was back before the failure was recorded, so the detect "
              "phase ends at the first moment anything noticed it)")


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
