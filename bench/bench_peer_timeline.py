"""Where a node's death goes, with a large state: detection, rendezvous, restore, first step.

Three daemons with peer replication (m=2) run ``examples/train.py`` (DDP, SGD with momentum,
one worker per node, ``--nnodes 2:3``) with a hidden layer wide enough that the three ranks'
states add up to ``--state-gib`` (default 1 GiB: parameters plus momentum, ~1/3 per rank),
snapshotted every step. Once a step is committed, the node holding rank 0 is killed with SIGKILL
(its shared memory deleted with it), so after the shrink to two ranks the new rank 0 must load
old rank 0's shard from a peer's RAM. Every log line of the survivors is stamped when it
appears; the result is the timeline from the kill:

* detection: the survivors' daemons log the peer's failure;
* rendezvous: torchrun's "Rendezvous complete" (the agents run with LOGLEVEL=INFO);
* restore: the workers' ``restored step S from SRC in T s`` line (with T, bytes and source);
* first step: the first training step at world size 2.

    .venv/bin/python bench/bench_peer_timeline.py --state-gib 1 \\
        --out bench/results/peer_timeline.json

CI's tests use small states (tests/integration/test_peer_recovery.py); this is the 1 GiB run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

from elasticd.launcher import JOB_USER, LocalCluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "examples", "train.py")
STEP_RE = re.compile(r"^step (\d+) world (\d+) rank")
RESTORED_RE = re.compile(r"restored step (\d+) from (\w+) in ([\d.]+) s, steps lost (\d+)")
DIM = 32  # examples/train.py's input width


def hidden_for(state_gib: float, ranks: int = 3) -> int:
    """Hidden width whose (params + momentum) x ranks is ``state_gib``: Linear(32, H) + Linear(H, 1)
    hold 34 H + 1 float32 parameters, each with a momentum buffer."""
    per_rank = state_gib * (1 << 30) / ranks
    return max(64, int(per_rank / (2 * 4 * (DIM + 2))))


class Tail:
    """Stamps every new line of some files with the monotonic time it was first seen."""

    def __init__(self, paths: dict[str, str]) -> None:
        self.paths, self.pos, self.lines = paths, {k: 0 for k in paths}, []
        for k, p in paths.items():
            self.pos[k] = os.path.getsize(p) if os.path.exists(p) else 0

    def poll(self, t0: float) -> None:
        now = time.monotonic() - t0
        for k, p in self.paths.items():
            try:
                with open(p, "rb") as fh:
                    fh.seek(self.pos[k])
                    data = fh.read()
            except FileNotFoundError:
                continue
            cut = data.rfind(b"\n") + 1
            self.pos[k] += cut
            for line in data[:cut].decode(errors="replace").splitlines():
                self.lines.append((now, k, line))

    def first(self, pattern: str, where: str = "") -> float | None:
        rx = re.compile(pattern)
        hits = [t for t, k, line in self.lines if k.startswith(where) and rx.search(line)]
        return min(hits) if hits else None

    def last_of_each(self, pattern: str, keys: list[str]) -> float | None:
        """When the pattern had appeared in every one of ``keys`` (None if not yet)."""
        rx = re.compile(pattern)
        times = []
        for key in keys:
            hits = [t for t, k, line in self.lines if k == key and rx.search(line)]
            if not hits:
                return None
            times.append(min(hits))
        return max(times)


def run(args: argparse.Namespace) -> dict:
    hidden = args.hidden or hidden_for(args.state_gib)
    state_bytes = 3 * 2 * 4 * ((DIM + 2) * hidden + 1)
    with tempfile.TemporaryDirectory(prefix="elasticd-bench-") as d:
        c = LocalCluster(["n1", "n2", "n3"], workdir=d, lease_ttl=args.ttl, replication=True,
                         env={"LOGLEVEL": "INFO"})
        try:
            c.start()
            env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
            subprocess.run([sys.executable, "-m", "elasticd.cli.main", "submit", "job",
                            "--nnodes", "2:3", "--nproc-per-node", "1", "--user", JOB_USER, "--",
                            TRAIN, "--steps", "100000", "--step-time", str(args.step_time),
                            "--hidden", str(hidden)],
                           env=env, check=True, capture_output=True, timeout=60)
            logs = {n: os.path.join(d, n, "jobs", "job", "agent.log") for n in c.nodes}

            def text(n: str) -> str:
                return open(logs[n], errors="replace").read() if os.path.exists(logs[n]) else ""

            def steps_at(n: str, world: int) -> int:
                return sum(1 for line in text(n).splitlines()
                           if (m := STEP_RE.match(line)) and int(m.group(2)) == world)

            c.wait_for(lambda: all(steps_at(n, 3) >= args.warmup_steps for n in c.nodes),
                       args.timeout, f"{args.warmup_steps} steps at world size 3")
            c.wait_for(lambda: c.coordinator().get(c.keys.replication("job").committed),
                       args.timeout, "a committed step")
            victim = next(n for n in c.nodes
                          if c.nodes[n].http("/status")["job"]["ranks"] == [0])
            survivors = [n for n in c.nodes if n != victim]
            keys = {f"{n}/agent": logs[n] for n in survivors}
            keys.update({f"{n}/daemon": os.path.join(d, f"{n}.log") for n in survivors})
            tail = Tail(keys)
            t0 = time.monotonic()
            c.nodes[victim].kill()
            agents = [f"{n}/agent" for n in survivors]
            first_step = None
            while time.monotonic() - t0 < args.timeout and first_step is None:
                time.sleep(0.02)
                tail.poll(t0)
                first_step = tail.last_of_each(r"^step \d+ world 2 rank", agents)
            restores = [RESTORED_RE.search(line) for _, k, line in tail.lines
                        if k in agents and RESTORED_RE.search(line)]
            result = {
                "victim": victim,
                "detection_seconds": tail.last_of_each(rf"observed: {victim} failed",
                                                       [f"{n}/daemon" for n in survivors]),
                "rendezvous_complete_seconds": tail.last_of_each("Rendezvous complete", agents),
                "restored_seconds": tail.last_of_each(RESTORED_RE.pattern, agents),
                "first_step_seconds": first_step,
                "restores": [{"step": int(m.group(1)), "source": m.group(2),
                              "restore_seconds": float(m.group(3)),
                              "steps_lost": int(m.group(4))} for m in restores],
            }
            bytes_re = re.compile(r"restored from (\w+): step (\d+), ([\d.]+) s, (\d+) bytes")
            result["restore_bytes"] = [int(m.group(4)) for _, k, line in tail.lines
                                       if k.endswith("daemon") and (m := bytes_re.search(line))]
        finally:
            c.stop()
    return {"benchmark": "peer_recovery_timeline",
            "command": "bench/bench_peer_timeline.py " + " ".join(sys.argv[1:]),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "job": f"examples/train.py --hidden {hidden}: 3 ranks x (Linear(32,{hidden}) + "
                   f"Linear({hidden},1), SGD momentum), snapshot every step, m=2",
            "state_bytes_total": state_bytes, "lease_ttl_seconds": args.ttl, **result}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-gib", type=float, default=1.0, help="total state over 3 ranks")
    p.add_argument("--hidden", type=int, default=0, help="override the hidden width")
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--ttl", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", default="bench/results/peer_timeline.json")
    args = p.parse_args()
    result = run(args)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result, indent=2))
    return 0 if result.get("first_step_seconds") is not None else 1


if __name__ == "__main__":
    sys.exit(main())
