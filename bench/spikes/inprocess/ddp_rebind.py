"""Spike for issue 31 (d): a DDP job whose survivors stay in their processes across a shrink
and a rejoin. torch 2.13, gloo, CPU.

6 ranks = 3 simulated nodes x 2 (common.py). The model (an MLP, ``--width``) and its optimizer
are built once per process, outside the re-entered part; its inner module is compiled
(``torch.compile``, ``--backend aot_eager`` by default) and counted with dynamo's
``CompileCounterWithBackend``. Each round: a group on a fresh prefix, ``DDP(inner)`` built
again around the same module, training steps. Phases:

1. world 6 (round 0) until step ``--fault-step``; then node 2 faults (``--fault kill``: SIGKILL;
   ``--fault freeze``: SIGSTOP, and ``--unstick-after`` s later the controller tells survivors
   to abort, which they can do only with ``--hook abortable``: DDP's gradient all_reduce runs
   through a comm hook whose futures a watcher thread can fail);
2. survivors leave the group (DDP dropped, ``gc.collect()``, ``destroy_process_group``; with a
   frozen peer the old group is kept aside, ``--old-group graveyard``, or destroyed), get ranks
   0..3 of world 4 (round 1), rebuild DDP and train ``--steps`` steps;
3. rejoin: 2 fresh processes (the restarted path: fresh interpreter state, compile from
   scratch) join round 2 as ranks 4, 5 while the survivors leave round 1 at a step boundary
   (a planned re-formation) and rebuild DDP at world 6, ``--steps`` steps.

Reported per survivor: compiles (frames dynamo compiled) after each round, DDP constructor
seconds per round, fault -> first step of the new round done, leave seconds; per newcomer:
process start -> first step done and its compiles (the restart path's cost for the same
model, warm). One JSON object in ``--out``.

    flock /tmp/elasticd-cpu.lock .venv/bin/python bench/spikes/inprocess/ddp_rebind.py \\
        --out bench/results/spikes/inprocess/ddp_kill.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import signal
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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
    """This rank is to leave its group (planned, or told to abort)."""


class AbortableAllreduce:
    """DDP comm hook: the bucket's all_reduce runs async, and the future DDP waits on is ours,
    so a watcher thread can fail it (``abort``) while the training thread waits in backward —
    gloo's own work cannot be aborted (pytorch #130345) and stays behind in the old group."""

    def __init__(self, group, world: int) -> None:
        self.group, self.world = group, world
        self.lock = threading.Lock()
        self.pending: set = set()
        self.aborted: BaseException | None = None

    def __call__(self, _state, bucket):
        import torch
        import torch.distributed as dist

        t = bucket.buffer()
        t.div_(self.world)
        out = torch.futures.Future()
        with self.lock:
            if self.aborted is not None:
                out.set_exception(self.aborted)
                return out
            self.pending.add(out)
        work = dist.all_reduce(t, group=self.group, async_op=True)

        def done(fut) -> None:
            with self.lock:
                if out not in self.pending:
                    return  # aborted first
                self.pending.discard(out)
            try:
                fut.wait()
                out.set_result(t)
            except Exception as exc:  # noqa: BLE001
                out.set_exception(exc)

        work.get_future().add_done_callback(done)
        return out

    def abort(self, exc: BaseException) -> int:
        with self.lock:
            self.aborted = exc
            pending, self.pending = list(self.pending), set()
        for fut in pending:
            fut.set_exception(exc)
        return len(pending)


def abortable_hook(h: AbortableAllreduce):
    """DDP wants a function (it reads the hook's ``__name__``)."""

    def abortable_allreduce(state, bucket):
        return h(state, bucket)

    return abortable_allreduce


def build(args: dict):
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(args["depth"]):
        layers += [torch.nn.Linear(args["width"], args["width"]), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(args["width"], 1))
    return net


def worker(rank: int, round_: int, world: int, args: dict, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.nn.parallel import DistributedDataParallel as DDP

    born = time.time()
    # As elasticd's zygote does after its preload: what was imported is never garbage, and a
    # full collection (which leaving a group needs, to free cycles that hold it) skips it.
    gc.collect()
    gc.freeze()
    torch.set_num_threads(1)
    ctl = client(port)
    me = f"p{os.getpid()}"
    net = build(args)
    counter = CompileCounterWithBackend(args["backend"])
    inner = torch.compile(net, backend=counter) if args["compile"] else net
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    rec: dict = {"first_rank": rank, "pid": os.getpid(), "born": born, "rounds": []}
    step = int(ctl.get("step0")) if ctl.check(["step0"]) else 0
    hook: list = [None]
    fault_at: dict = {}

    def watcher() -> None:
        w = client(port, 600)
        try:
            w.wait([f"unstick/{round_at[0]}"])
        except Exception:  # noqa: BLE001
            return
        fault_at["unstick"] = time.time()
        h = hook[0]
        fault_at["aborted_futures"] = h.abort(Reformation("told to abort")) if h else 0

    if round_ > 0:  # a newcomer: stage (build and compile) before its round re-forms the others
        g = torch.Generator().manual_seed(12345)
        inner(torch.randn(args["batch"], args["width"], generator=g)).sum().backward()
        opt.zero_grad(set_to_none=True)
        rec["staged_at"] = time.time()
        ctl.set(f"staged/{me}", "1")
    round_at = [round_]
    if args["fault"] == "freeze":
        threading.Thread(target=watcher, daemon=True).start()
    graveyard: list = []
    while True:
        rr: dict = {"round": round_, "rank": rank, "world": world}
        t0 = time.perf_counter()
        dist.init_process_group("gloo", store=dist.PrefixStore(f"round{round_}/", ctl),
                                rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args["timeout"]))
        rr["init_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        ddp = DDP(inner)
        if args["hook"] == "abortable":
            hook[0] = AbortableAllreduce(dist.group.WORLD, world)
            ddp.register_comm_hook(None, abortable_hook(hook[0]))
        rr["ddp_ctor_s"] = time.perf_counter() - t1
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
                y = torch.randn(args["batch"], 1, generator=g)
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                steps += 1
                if steps == 1:
                    rr["first_step_done_at"] = time.time()
                if rank == 0:
                    ctl.set(f"r{round_}/step", str(steps))
        except (Exception, Reformation) as exc:  # noqa: BLE001
            rr["raised_at"] = time.time()
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            if ctl.check(["finish"]):  # a peer finished first and left: so do we
                why = "finished"
        rr["why"] = why
        rr["steps"] = steps
        rr["compiles"] = counter.frame_count
        rr.update({k: v for k, v in fault_at.items()})
        fault_at.clear()
        # Leave the group: nothing of this round may keep it alive.
        t2 = time.perf_counter()
        rr["left_at"] = time.time()
        pg = dist.group.WORLD
        del ddp
        hook[0] = None
        opt.zero_grad(set_to_none=True)  # gradients of a broken step
        if args["fault"] == "freeze" and args["old_group"] == "graveyard":
            # Unregistered as any destroy does (which also resets the group counter, so this
            # process names its next groups as a fresh process does), but not destructed: the
            # destructor of a gloo group joins its threads, one of them stuck in the frozen
            # peer's collective until the group's timeout.
            graveyard.append(pg)
            dist.destroy_process_group()
        else:
            del pg
            t3 = time.perf_counter()
            gc.collect()
            rr["gc_s"] = time.perf_counter() - t3
            dist.destroy_process_group()
        rr["leave_s"] = time.perf_counter() - t2
        rec["rounds"].append(rr)
        if why == "finished":
            break
        ctl.set(f"alive/{round_ + 1}/{me}", json.dumps([rank, step]))
        round_at[0] = round_ + 1
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
    ap.add_argument("--fault", choices=["kill", "freeze"], default="kill")
    ap.add_argument("--hook", choices=["none", "abortable"], default="none")
    ap.add_argument("--old-group", choices=["graveyard", "destroy"], default="graveyard")
    ap.add_argument("--unstick-after", type=float, default=0.5)
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--fault-step", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    conf = vars(args)
    ctx = forkserver(("torch", "torch.distributed", "torch._dynamo",
                      "torch.nn.parallel"))
    ctl, port = controller_store()
    procs = {r: ctx.Process(target=_entry, args=(r, 0, WORLD, conf, port))
             for r in range(WORLD)}
    for p in procs.values():
        p.start()
    out: dict = {"command": " ".join(sys.argv), "args": conf}
    fresh: list = []
    try:
        def step_of(rnd: int) -> int:
            return int(ctl.get(f"r{rnd}/step")) if ctl.check([f"r{rnd}/step"]) else 0

        deadline = time.time() + 300
        while step_of(0) < args.fault_step:
            if time.time() > deadline:
                raise TimeoutError("round 0 did not train")
            time.sleep(0.005)
        victims = node_ranks(2)
        out["fault_at"] = time.time()
        for r in victims:
            os.kill(procs[r].pid, signal.SIGSTOP if args.fault == "freeze" else signal.SIGKILL)
        if args.fault == "freeze":
            time.sleep(args.unstick_after)
            out["unstick_at"] = time.time()
            ctl.set("unstick/1", "1")
        survivors = [procs[r] for r in range(WORLD) if r not in victims]
        keys = [f"alive/1/p{p.pid}" for p in survivors]
        wait_all(ctl, keys, args.timeout + 60)
        out["all_left_at"] = time.time()
        alive = sorted((json.loads(ctl.get(k))[0], k) for k in keys)
        for new, (_old, key) in enumerate(alive):
            ctl.set(key.replace("alive/", "assign/"), json.dumps([new, len(alive), 1]))
        deadline = time.time() + 300
        while step_of(1) < args.steps:
            if time.time() > deadline:
                raise TimeoutError("round 1 did not train")
            time.sleep(0.005)
        # Rejoin: two fresh processes (the restart path) and a planned re-formation of the rest.
        ctl.set("step0", "0")
        out["rejoin_at"] = time.time()
        fresh = [ctx.Process(target=_entry, args=(len(alive) + i, 2, len(alive) + 2, conf, port))
                 for i in range(2)]
        for p in fresh:
            p.start()
        wait_all(ctl, [f"staged/p{p.pid}" for p in fresh], 120)
        out["newcomers_staged_at"] = time.time()
        ctl.set("reform/1", "1")
        keys = [f"alive/2/p{p.pid}" for p in survivors]
        wait_all(ctl, keys, 120)
        out["survivors_left_round1_at"] = time.time()
        for key in keys:
            rank = json.loads(ctl.get(key))[0]
            ctl.set(key.replace("alive/", "assign/"), json.dumps([rank, len(alive) + 2, 2]))
        deadline = time.time() + 300
        while step_of(2) < args.steps:
            if time.time() > deadline:
                raise TimeoutError("round 2 did not train")
            time.sleep(0.005)
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
    out["summary"] = summarise(out)
    print(json.dumps(out["summary"], indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


def summarise(out: dict) -> dict:
    surv = [w for w in out.get("workers", []) if w["first_rank"] < WORLD and len(w["rounds"]) == 3]
    new = [w for w in out.get("workers", []) if len(w["rounds"]) == 1]
    s: dict = {"survivors": len(surv), "newcomers": len(new)}
    if surv:
        s["survivor_compiles_per_round"] = [w and [r["compiles"] for r in w["rounds"]]
                                           for w in surv]
        s["survivor_recompiles_after_round0"] = max(
            w["rounds"][2]["compiles"] - w["rounds"][0]["compiles"] for w in surv)
        s["ddp_ctor_s_round0"] = med([w["rounds"][0]["ddp_ctor_s"] for w in surv])
        s["ddp_ctor_s_round1"] = med([w["rounds"][1]["ddp_ctor_s"] for w in surv])
        s["ddp_ctor_s_round2"] = med([w["rounds"][2]["ddp_ctor_s"] for w in surv])
        s["leave_s_after_fault"] = med([w["rounds"][0]["leave_s"] for w in surv])
        s["raise_after_fault_s"] = med([w["rounds"][0]["raised_at"] -
                                        out.get("unstick_at", out["fault_at"]) for w in surv])
        s["fault_to_first_step_round1_s"] = {
            "median": med([w["rounds"][1]["first_step_done_at"] - out["fault_at"]
                           for w in surv]),
            "max": round(max(w["rounds"][1]["first_step_done_at"] - out["fault_at"]
                             for w in surv), 4)}
        s["rejoin_survivor_stop_s"] = {  # planned leave -> first step at world 6
            "max": round(max(w["rounds"][2]["first_step_done_at"] - w["rounds"][1]["raised_at"]
                             for w in surv), 4)}
        s["why_round0_ended"] = sorted({w["rounds"][0]["why"][:90] for w in surv})
    if new:
        s["newcomer_start_to_staged_s"] = med([w["staged_at"] - out["rejoin_at"] for w in new])
        s["newcomer_start_to_first_step_s"] = med([w["rounds"][0]["first_step_done_at"] -
                                                   out["rejoin_at"] for w in new])
        s["newcomer_compiles"] = [w["rounds"][0]["compiles"] for w in new]
    return s


if __name__ == "__main__":
    main()
