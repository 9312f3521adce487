"""Training throughput with a snapshot every step, through the real socket and service.

A reference job — an MLP of ``--layers`` Linear(``--width``, ``--width``) layers with Adam,
batch ``--batch``, ``--threads`` torch threads, one process — trains in interleaved blocks of
``--steps`` steps, ``--rounds`` times, in three modes:

* ``off``: no checkpointing (the baseline);
* ``overlap``: ``elasticd.Checkpointer`` every step, the copy on a background thread
  overlapping the next forward/backward (the default);
* ``sync``: the same with the copy done inside ``save`` (what a non-overlapped snapshot costs);
* ``replicated`` (with ``--replicate``): ``overlap`` against a second daemon that also pushes
  every snapshot to a peer daemon (m=2) over the real replication transport on loopback;
* ``copy_floor``: no elasticd: one background ``_foreach_copy_`` of the state's tensors into
  memory faulted in beforehand after every step (:class:`CopyFloor`), the least any snapshot
  taken every step must do; its cost is the host's price for moving the state's bytes once a
  step beside training.

The daemon side (SlotStore + CheckpointService behind a LocalServer on a Unix socket) runs in a
separate process, as the real daemon does, so sealing (xxh3) uses its own core. Per mode it
reports the mean step time, the throughput cost against ``off`` (of the means, and paired:
the median over rounds of each round's median step against that round's ``off`` block, with a
bootstrap 95 % interval) and, per snapshot, the time the
loop waited in ``save`` (stall) and in the optimizer pre-hook, the background copy and the seal.
The memcpy of the same bytes into pre-touched memory is measured in the same run as a baseline.
With ``--replicate`` it also reports the CPU seconds the daemon side (both daemons and the peer)
spent per GiB snapshotted, with and without replication: the difference is what replication
costs.
With ``--fsdp`` the model is sharded with FSDP2 (``fully_shard`` per layer, a one-rank gloo
group: DTensor parameters and Adam state), so the snapshot goes through the sharded path
(local shards plus their layout in the meta); the ``off`` baseline is the same FSDP2 model.
Run under ``flock /tmp/elasticd-cpu.lock`` on shared machines::

    python bench/bench_checkpoint.py --layers 48 --width 384 --batch 256
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid


SECRET = b"bench-secret-0123456789abcdef"


def _peer(conn, root: str) -> None:
    """A peer daemon's replica half: a ReplicaServer storing into its own slot store."""
    from elasticd.store.shm import SlotStore
    from elasticd.replication.shm_sink import ShmSink
    from elasticd.replication.transport import ReplicaServer

    store = SlotStore(root)
    server = ReplicaServer("127.0.0.1", 0, SECRET, "peer", ShmSink(store)).start()
    conn.send(server.address)
    conn.recv()  # until the daemon half is done
    server.stop()
    store.close()


def serve(sockdir: str, shm: str, replicate: bool = False) -> None:
    """The daemon half (no torch): serves the checkpoint ops until stdin closes. With
    ``replicate``, a peer process holds a replica of every snapshot (m=2). At the end one
    JSON line: the service's skipped snapshots by reason, and the replicator's counters."""
    import multiprocessing as mp

    from elasticd.store.service import CheckpointService
    from elasticd.store.shm import SlotStore
    from elasticd.daemon.local_api import LocalServer

    store = SlotStore(shm)
    replicator = peer = pipe = None
    if replicate:
        from elasticd.coordination.keys import Keyspace
        from elasticd.testing.coordination import MemoryCoordinator
        from elasticd.recovery.replicator import Replicator

        pipe, child = mp.Pipe()
        peer = mp.get_context("fork").Process(target=_peer, args=(child, shm + "-peer"))
        peer.start()
        address = pipe.recv()
        replicator = Replicator("local", MemoryCoordinator(), Keyspace("/bench"), store, SECRET,
                                m=2, peers_address=lambda n: address if n == "peer" else None,
                                commit_wait=0.0)
        replicator.set_membership("bench", ["local", "peer"], {"local": [0], "peer": []})
    service = CheckpointService(store, "bench", replicator=replicator)
    server = LocalServer(os.path.join(sockdir, "d.sock"), service.handlers())
    server.start()
    print(f"READY {peer.pid if peer else 0}", flush=True)
    sys.stdin.read()
    server.stop()
    skips = {k.removeprefix("skipped_"): n for k, n in service.counters.items()
             if k.startswith("skipped_") and n}
    if replicator is not None:
        replicator.wait_idle(60)
    print(json.dumps({"skipped_by_reason": skips, "replication": dataclasses.asdict(
        replicator.stats()) if replicator is not None else None}), flush=True)
    if replicator is not None:
        replicator.close()
        pipe.send("stop")
        peer.join(30)
        shutil.rmtree(shm + "-peer", ignore_errors=True)
    store.close()


def run(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    from elasticd.worker.checkpointer import Checkpointer
    from elasticd.worker.copier import CpuCopier
    from elasticd.worker.client import DaemonClient

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    if args.fsdp:
        import socket

        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width)
    state = {"model": model, "optim": opt}

    def step() -> None:
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()  # Adam's state exists from here on
    nbytes = sum(t.numel() * t.element_size() for t in
                 list(model.state_dict().values()) + [v for s in opt.state.values()
                                                      for v in s.values()])
    ntensors = len(model.state_dict()) + sum(len(s) for s in opt.state.values())
    src = np.ones(nbytes, np.uint8)
    dst = np.empty(nbytes, np.uint8)
    dst[::4096] = 1
    memcpy = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))

    import psutil

    tag = uuid.uuid4().hex[:8]
    daemons: dict[str, tuple[subprocess.Popen, str, str]] = {}
    rep_stats: dict = {}
    skip_reasons: dict[str, dict[str, int]] = {}  # daemon kind -> reason -> snapshots
    cpu: dict[str, float] = {}
    try:
        clients, procs = {}, {}
        for kind in ["plain", "replicated"] if args.replicate else ["plain"]:
            sockdir = tempfile.mkdtemp(prefix="edb-")
            shm = f"/dev/shm/elasticd-bench-{tag}-{kind}"
            argv = [sys.executable, __file__, "--serve", sockdir, shm] + (
                ["replicate"] if kind == "replicated" else [])
            daemon = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
            daemons[kind] = (daemon, sockdir, shm)
            ready, _, peer_pid = daemon.stdout.readline().strip().partition(" ")
            assert ready == "READY", ready
            procs[kind] = [psutil.Process(daemon.pid)] + (
                [psutil.Process(int(peer_pid))] if int(peer_pid) else [])
            clients[kind] = DaemonClient(os.path.join(sockdir, "d.sock"), timeout=60)
        ckpts = {"overlap": Checkpointer(transport=clients["plain"], job="bench", rank=0,
                                         world_size=1),
                 "sync": Checkpointer(transport=clients["plain"], job="bench", rank=0,
                                      world_size=1, copier=CpuCopier(background=False))}
        if args.replicate:
            ckpts["replicated"] = Checkpointer(transport=clients["replicated"], job="bench",
                                               rank=0, world_size=1)
        floor = CopyFloor(state)
        for mode in ckpts.values():  # warm-up: slots allocated, mappings made, layouts cached
            for i in range(2):
                step()
                mode.save(i + 1, state)
            mode.wait()
            for k in mode.stats:
                mode.stats[k] = 0
        times: dict[str, list[float]] = {m: [] for m in ["off", *ckpts, "copy_floor"]}
        # Per round, each mode's median step: the paired estimate below compares a mode with
        # the "off" block of the same round, so the host's drift between rounds cancels.
        round_medians: dict[str, list[float]] = {m: [] for m in times}

        def cpu_seconds(kind: str) -> float:
            return sum(t.user + t.system for t in (p.cpu_times() for p in procs[kind]))

        cpu0 = {kind: cpu_seconds(kind) for kind in procs}
        n = 0
        for _ in range(args.rounds):
            for mode in times:
                ckpt = floor if mode == "copy_floor" else ckpts.get(mode)
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    step()
                    n += 1
                    if ckpt is not None:
                        ckpt.save(n, state)
                    times[mode].append(time.perf_counter() - t0)
                round_medians[mode].append(statistics.median(times[mode][-args.steps:]))
                if ckpt is not None:
                    ckpt.wait()
        time.sleep(0.5)  # the last seals and pushes
        cpu = {kind: cpu_seconds(kind) - cpu0[kind] for kind in procs}
        for ckpt in ckpts.values():
            ckpt.close()
        floor.close()
        for client in clients.values():
            client.close()
    finally:
        for kind, (daemon, sockdir, shm) in daemons.items():
            out, _ = daemon.communicate(timeout=90)
            if out.strip():
                last = json.loads(out.strip().splitlines()[-1])
                skip_reasons[kind] = last["skipped_by_reason"]
                rep_stats = last["replication"] or rep_stats
            shutil.rmtree(sockdir, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)

    if args.fsdp:
        import torch.distributed as dist

        dist.destroy_process_group()
    base = statistics.fmean(times["off"])
    result = {"state_bytes": nbytes, "tensors": ntensors, "threads": args.threads,
              "fsdp": args.fsdp,
              "batch": args.batch, "layers": args.layers, "width": args.width,
              "steps_per_mode": len(times["off"]), "memcpy_seconds": memcpy, "modes": {},
              # The daemons' own count, warm-up included: "plain" serves overlap and sync.
              "daemon_skipped_by_reason": skip_reasons}
    for mode, ts in times.items():
        row = {"step_seconds_mean": statistics.fmean(ts), "step_seconds_median":
               statistics.median(ts), "throughput_cost": statistics.fmean(ts) / base - 1}
        if mode in ckpts:
            s, saves = ckpts[mode].stats, max(1, ckpts[mode].stats["saves"])
            row.update(saves=s["saves"], skipped=s["skipped"], failed=s["failed"],
                       **{f"{k}_per_snapshot": s[k] / saves for k in
                          ("stall_seconds", "hook_wait_seconds", "copy_seconds",
                           "seal_seconds")})
        if mode != "off":
            row.update(paired_cost(round_medians[mode], round_medians["off"]))
        result["modes"][mode] = row
    gib = nbytes / 2**30
    plain_saves = sum(ckpts[m].stats["saves"] for m in ("overlap", "sync"))
    result["daemon_cpu_seconds_per_gib_snapshotted"] = cpu["plain"] / (plain_saves * gib)
    if args.replicate:
        saves = ckpts["replicated"].stats["saves"]
        pushed = rep_stats.get("replication_bytes_total", 0)
        result["replication"] = {
            "pushes": rep_stats.get("replication_pushes_total"),
            "bytes_pushed": pushed,
            "skipped": rep_stats.get("replication_skipped_total"),
            "failures": rep_stats.get("replication_failures_total"),
            "commits": rep_stats.get("commits_total"),
            # Both daemons (owner and peer) count: sealing, pushing and receiving.
            "daemon_cpu_seconds_per_gib_snapshotted": cpu["replicated"] / (saves * gib),
            "cpu_seconds_per_gib_replicated": (
                (cpu["replicated"] - result["daemon_cpu_seconds_per_gib_snapshotted"]
                 * saves * gib) / (pushed / 2**30) if pushed else None),
        }
    return result


class CopyFloor:
    """The floor of any snapshot taken every step, as a mode: after each step, one copy of
    every tensor of the state (the same live tensors a snapshot copies: FSDP2's local shards,
    Adam's moments) into memory faulted in beforehand, by one ``_foreach_copy_`` on a
    background thread that overlaps the next step, as elasticd's copy does. No daemon, no
    flatten per step, no checksum. What this costs the step is what the host charges for
    moving the state's bytes once per step beside training (memory bandwidth, caches, the
    second core), whatever the snapshot does besides."""

    def __init__(self, state) -> None:
        import concurrent.futures

        import torch

        from elasticd.worker.state import flatten

        self.src = flatten(state).tensors
        self.dst = [torch.empty_like(t) for t in self.src]
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="floor-copy")
        self._copy()  # fault the destination in
        self._done = None

    def _copy(self) -> None:
        import torch

        with torch.no_grad():
            torch._foreach_copy_(self.dst, self.src)

    def save(self, step: int, state) -> None:
        self.wait()
        self._done = self._pool.submit(self._copy)

    def wait(self) -> None:
        if self._done is not None:
            self._done.result()
            self._done = None

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()


def paired_cost(mode: list[float], off: list[float], resamples: int = 2000) -> dict:
    """The cost of a mode against "off" from per-round medians: each round's ratio, their
    median, and a bootstrap 95 % interval of that median (a fixed seed: the same rounds give
    the same interval). Robust to the host's slow drifts and to single slow steps, which move
    a mean over every step."""
    import random

    ratios = [m / o - 1 for m, o in zip(mode, off)]
    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                   for _ in range(resamples))
    return {"paired_cost_per_round": [round(r, 4) for r in ratios],
            "paired_cost_median": statistics.median(ratios),
            "paired_cost_ci95": [boots[int(0.025 * resamples)],
                                 boots[int(0.975 * resamples) - 1]]}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def skipped_cell(row: dict) -> str:
    """The table's ``skipped`` cell: snapshots skipped of those asked for, e.g. ``11/80``."""
    return f"{row['skipped']}/{row['saves'] + row['skipped']}"


def skipped_notes(r: dict) -> list[str]:
    """One line per mode that skipped snapshots: how many, why (the daemon's reasons), and
    what its figures then cover: a cost measured over fewer snapshots than steps."""
    notes = []
    for mode, row in r["modes"].items():
        if not row.get("skipped"):
            continue
        kind = "replicated" if mode == "replicated" else "plain"
        why = ", ".join(f"{reason} {n}" for reason, n in
                        sorted(r.get("daemon_skipped_by_reason", {}).get(kind, {}).items()))
        notes.append(f"note: {mode} skipped {row['skipped']} of "
                     f"{row['saves'] + row['skipped']} snapshots (daemon's reasons: "
                     f"{why or 'not reported'}); its cost and per-snapshot figures cover the "
                     f"{row['saves']} it took")
    return notes


def report(r: dict) -> None:
    mib = r["state_bytes"] / 2**20
    kind = "FSDP2 (1 rank) " if r.get("fsdp") else ""
    print(f"reference job: {kind}MLP {r['layers']} x Linear({r['width']}, {r['width']}) + Adam, "
          f"batch {r['batch']}, {r['threads']} torch thread(s); state {mib:.0f} MiB in "
          f"{r['tensors']} tensors; {r['steps_per_mode']} steps per mode, interleaved")
    print(f"memcpy of the state into pre-touched memory: {r['memcpy_seconds'] * 1e3:.1f} ms "
          f"({r['state_bytes'] / r['memcpy_seconds'] / 1e9:.1f} GB/s)")
    print(f"{'mode':<10} {'step ms':>8} {'cost':>7} {'skipped':>8} {'stall ms':>9} "
          f"{'hook ms':>8} {'copy ms':>8} {'seal ms':>8}")
    for mode, row in r["modes"].items():
        extra = (f" {'-':>8}" if "saves" not in row else
                 f" {skipped_cell(row):>8}"
                 f" {row['stall_seconds_per_snapshot'] * 1e3:>9.2f}"
                 f" {row['hook_wait_seconds_per_snapshot'] * 1e3:>8.2f}"
                 f" {row['copy_seconds_per_snapshot'] * 1e3:>8.2f}"
                 f" {row['seal_seconds_per_snapshot'] * 1e3:>8.2f}")
        paired = ("" if "paired_cost_median" not in row else
                  f"   paired {row['paired_cost_median']:+.1%} [{row['paired_cost_ci95'][0]:+.1%},"
                  f" {row['paired_cost_ci95'][1]:+.1%}]")
        print(f"{mode:<10} {row['step_seconds_mean'] * 1e3:>8.1f} "
              f"{row['throughput_cost']:>+7.1%}{extra}{paired}")
    for line in skipped_notes(r):
        print(line)
    print(f"daemon CPU per GiB snapshotted: {r['daemon_cpu_seconds_per_gib_snapshotted']:.3f} s")
    if "replication" in r:
        print("replication:", json.dumps(r["replication"]))


def main() -> None:
    if len(sys.argv) in (4, 5) and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3], replicate=len(sys.argv) == 5)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--rounds", type=int, default=4, help="blocks per mode, interleaved")
    parser.add_argument("--replicate", action="store_true",
                        help="add the mode whose daemon replicates every snapshot to a peer")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard the model with FSDP2 (one-rank gloo group): DTensor state")
    args = parser.parse_args()
    result = run(args)
    report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
