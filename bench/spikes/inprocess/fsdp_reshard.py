"""Spike for issue 31 (e): FSDP2 survivors reshard in their own processes after a node dies,
through elasticd's restore path (``elasticd.worker.state.load_into`` and its ``Resharder``).
torch 2.13, gloo, CPU.

``fully_shard`` cannot be applied to a module twice (torch 2.13: "Each distinct composable
distributed API can only be applied to a module once"), so each round builds the model again
for its mesh: on the meta device (no memory, no init), ``fully_shard`` per layer and on the
root, ``to_empty`` on the CPU, a new Adam; then ``load_into`` fills it from this rank's own
snapshot plus the other old ranks' shards its new shards overlap
(``elasticd.worker.shards.needed_ranks``). Snapshots are written to files every step (the
stand-in for the slots in the node's RAM and the replicas in peers' RAM); each round's rank 0
also writes the full parameters of every step, the reference the next round's load is checked
against.

Phases: world 6 (3 nodes x 2) until ``--fault-step``; SIGKILL of node 1 (ranks 2, 3); the 4
survivors leave the group, get ranks 0..3 of world 4, rebuild, load the newest step every old
rank saved, check their parameters against the reference (bit for bit, through
``full_tensor``), and train ``--steps`` steps; then 2 fresh processes (the restart path) join,
everyone rebuilds at world 6 from the world-4 snapshots, checks against the reference again and
trains. ``--compile`` wraps each round's model in ``torch.compile`` (``--backend``) with one
counter per process: the recompile count on survivors.

    flock /tmp/elasticd-cpu.lock .venv/bin/python bench/spikes/inprocess/fsdp_reshard.py \\
        --out bench/results/spikes/inprocess/fsdp_kill.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import glob
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.dirname(os.path.abspath(__file__))))))
from common import (  # noqa: E402
    WORLD,
    client,
    controller_store,
    forkserver,
    med,
    node_ranks,
    stop_all,
    wait_all,
)


class Reformation(Exception):
    """Planned: leave the group at a step boundary."""


def build(args: dict, mesh, meta: bool):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        layers = [torch.nn.Linear(args["width"], args["width"]) for _ in range(args["depth"])]
        model = torch.nn.Sequential(*layers)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if meta:
        model.to_empty(device="cpu")
    return model


def save(snapdir: str, round_: int, rank: int, step: int, state) -> None:
    import torch

    from elasticd.worker.state import flatten

    flat = flatten(state)
    path = os.path.join(snapdir, f"r{round_}_k{rank}_s{step}.pt")
    torch.save({"names": flat.names, "tensors": [t.detach().clone() for t in flat.tensors],
                "meta": flat.meta}, path + ".tmp")
    os.replace(path + ".tmp", path)


def newest_common(snapdir: str, round_: int, world: int) -> int:
    steps = []
    for k in range(world):
        mine = [int(p.rsplit("_s", 1)[1][:-3]) for p in
                glob.glob(os.path.join(snapdir, f"r{round_}_k{k}_s*.pt"))]
        steps.append(set(mine))
    return max(set.intersection(*steps))


def worker(rank: int, round_: int, world: int, args: dict, port: int, snapdir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.distributed.device_mesh import init_device_mesh

    from elasticd.worker import shards
    from elasticd.worker.state import load_into

    gc.collect()
    gc.freeze()  # as elasticd's zygote does
    torch.set_num_threads(1)
    ctl = client(port)
    me = f"p{os.getpid()}"
    counter = CompileCounterWithBackend(args["backend"])
    rec: dict = {"first_rank": rank, "pid": os.getpid(), "born": time.time(), "rounds": []}
    prev = None  # (round, old rank, old world) of the snapshots to load; None: a fresh start
    if round_ > 0:
        prev = tuple(json.loads(ctl.get("restore_from")))
        rec["staged_at"] = time.time()
        ctl.set(f"staged/{me}", "1")
    while True:
        rr: dict = {"round": round_, "rank": rank, "world": world}
        t0 = time.perf_counter()
        dist.init_process_group("gloo", store=dist.PrefixStore(f"round{round_}/", ctl),
                                rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args["timeout"]))
        mesh = init_device_mesh("cpu", (world,))
        rr["init_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        model = build(args, mesh, meta=prev is not None)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        run = torch.compile(model, backend=counter) if args["compile"] else model
        rr["rebuild_s"] = time.perf_counter() - t1
        state = {"model": model, "optim": opt}
        step = 0
        if prev is not None:
            p_round, p_rank, p_world = prev
            step = newest_common(snapdir, p_round, p_world)
            t2 = time.perf_counter()

            def read(k: int):
                return torch.load(os.path.join(snapdir, f"r{p_round}_k{k}_s{step}.pt"))

            if p_rank is None:  # a newcomer: old rank r % old world, as restore.py does
                p_rank = rank % p_world
            base = read(p_rank)
            need = shards.needed_ranks(base["meta"], p_world, p_rank, shards.live_meshes(state))
            others = [read(k) for k in need[1:]]
            rr["read_s"] = time.perf_counter() - t2
            t3 = time.perf_counter()
            load_into(state, base["tensors"], base["meta"], names=base["names"],
                      others=[(o["names"], o["tensors"], o["meta"]) for o in others])
            rr["load_into_s"] = time.perf_counter() - t3
            rr["restored_step"] = step
            rr["needed_old_ranks"] = need
            ref = torch.load(os.path.join(snapdir, f"ref_s{step}.pt"))
            full = {n: p.full_tensor() for n, p in model.named_parameters()}
            rr["bitwise_equal_to_reference"] = all(torch.equal(full[n], ref[n]) for n in ref)
        steps = 0
        why = "finished"
        try:
            while True:
                if ctl.check([f"reform/{round_}"]):
                    raise Reformation("planned")
                if ctl.check(["finish"]):
                    break
                g = torch.Generator().manual_seed(step * 1000 + rank)
                x = torch.randn(args["batch"], args["width"], generator=g)
                loss = run(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                steps += 1
                save(snapdir, round_, rank, step, state)
                full = {n: p.full_tensor() for n, p in model.named_parameters()}
                if rank == 0:  # the reference: the full parameters as this round has them
                    torch.save(full, os.path.join(snapdir, f"ref_s{step}.pt"))
                if steps == 1:
                    rr["first_step_done_at"] = time.time()
                if rank == 0:
                    ctl.set(f"r{round_}/step", str(steps))
        except (Exception, Reformation) as exc:  # noqa: BLE001
            rr["raised_at"] = time.time()
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            if ctl.check(["finish"]):
                why = "finished"
        rr.update(why=why, steps=steps, compiles=counter.frame_count)
        t4 = time.perf_counter()
        del state, model, opt, run, mesh
        gc.collect()
        dist.destroy_process_group()
        rr["leave_s"] = time.perf_counter() - t4
        rec["rounds"].append(rr)
        if why == "finished":
            break
        ctl.set(f"alive/{round_ + 1}/{me}", json.dumps([rank, step]))
        prev = (round_, rank, world)
        rank, world, round_ = json.loads(ctl.get(f"assign/{round_ + 1}/{me}"))
    ctl.set(f"result/{me}", json.dumps(rec))
    os._exit(0)


def _entry(*a) -> None:
    try:
        worker(*a)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        os._exit(3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=100)  # not a multiple of 4 or 6: uneven
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--fault-step", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    conf = vars(args)
    snapdir = tempfile.mkdtemp(prefix="fsdp-spike-", dir="/tmp")
    ctx = forkserver(("torch", "torch.distributed", "torch._dynamo",
                      "torch.distributed.fsdp", "torch.distributed.tensor"))
    ctl, port = controller_store()
    procs = {r: ctx.Process(target=_entry, args=(r, 0, WORLD, conf, port, snapdir))
             for r in range(WORLD)}
    for p in procs.values():
        p.start()
    out: dict = {"command": " ".join(sys.argv), "args": conf}
    fresh: list = []
    try:
        def step_of(rnd: int) -> int:
            return int(ctl.get(f"r{rnd}/step")) if ctl.check([f"r{rnd}/step"]) else 0

        def until(rnd: int, n: int) -> None:
            deadline = time.time() + 300
            while step_of(rnd) < n:
                if time.time() > deadline:
                    raise TimeoutError(f"round {rnd} did not train")
                time.sleep(0.005)

        until(0, args.fault_step)
        out["fault_at"] = time.time()
        for r in node_ranks(1):
            os.kill(procs[r].pid, signal.SIGKILL)
        survivors = [procs[r] for r in range(WORLD) if r not in node_ranks(1)]
        keys = [f"alive/1/p{p.pid}" for p in survivors]
        wait_all(ctl, keys, args.timeout + 60)
        alive = sorted((json.loads(ctl.get(k))[0], k) for k in keys)
        for new, (_old, key) in enumerate(alive):
            ctl.set(key.replace("alive/", "assign/"), json.dumps([new, len(alive), 1]))
        until(1, args.steps)
        out["rejoin_at"] = time.time()
        ctl.set("restore_from", json.dumps([1, None, len(alive)]))
        fresh = [ctx.Process(target=_entry, args=(len(alive) + i, 2, len(alive) + 2, conf, port,
                                                  snapdir)) for i in range(2)]
        for p in fresh:
            p.start()
        wait_all(ctl, [f"staged/p{p.pid}" for p in fresh], 120)
        ctl.set("reform/1", "1")
        keys = [f"alive/2/p{p.pid}" for p in survivors]
        wait_all(ctl, keys, 120)
        for key in keys:
            rank = json.loads(ctl.get(key))[0]
            ctl.set(key.replace("alive/", "assign/"), json.dumps([rank, len(alive) + 2, 2]))
        until(2, args.steps)
        ctl.set("finish", "1")
        results = []
        for p in survivors + fresh:
            wait_all(ctl, [f"result/p{p.pid}"], 120)
            results.append(json.loads(ctl.get(f"result/p{p.pid}")))
        out["workers"] = results
    except Exception as exc:  # noqa: BLE001
        out["controller_error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        out["exitcodes"] = stop_all(list(procs.values()) + fresh)
        shutil.rmtree(snapdir, ignore_errors=True)
    out["summary"] = summarise(out)
    print(json.dumps(out["summary"], indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


def summarise(out: dict) -> dict:
    surv = [w for w in out.get("workers", []) if len(w["rounds"]) == 3]
    new = [w for w in out.get("workers", []) if len(w["rounds"]) == 1]
    s: dict = {"survivors": len(surv), "newcomers": len(new)}
    if not surv:
        return s
    r1 = [w["rounds"][1] for w in surv]
    r2 = [w["rounds"][2] for w in surv]
    s["bitwise_equal_after_shrink"] = all(r.get("bitwise_equal_to_reference") for r in r1)
    s["bitwise_equal_after_rejoin"] = all(r.get("bitwise_equal_to_reference")
                                          for r in r2 + [w["rounds"][0] for w in new])
    s["compiles_per_round"] = [[r["compiles"] for r in w["rounds"]] for w in surv]
    s["newcomer_compiles"] = [w["rounds"][0]["compiles"] for w in new]
    for name, rows in (("shrink", r1), ("rejoin", r2)):
        s[name] = {k: med([r[k] for r in rows if k in r]) for k in
                   ("init_s", "rebuild_s", "read_s", "load_into_s")}
    s["leave_s_after_fault"] = med([w["rounds"][0]["leave_s"] for w in surv])
    s["fault_to_first_step_round1_s"] = med([r["first_step_done_at"] - out["fault_at"]
                                             for r in r1])
    s["rejoin_survivor_stop_s"] = round(max(
        w["rounds"][2]["first_step_done_at"] - w["rounds"][1]["raised_at"] for w in surv), 4)
    if new:
        s["newcomer_start_to_staged_s"] = med([w["staged_at"] - out["rejoin_at"] for w in new])
        s["newcomer_start_to_first_step_s"] = med([w["rounds"][0]["first_step_done_at"] -
                                                   out["rejoin_at"] for w in new])
    return s


if __name__ == "__main__":
    main()
