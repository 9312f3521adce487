"""Spike for issue 31 (a, b, c): what a gloo group does when a peer node dies or freezes, and
what it costs survivors to leave it and form a new one in the same process. torch 2.13, CPU.

6 ranks = 3 simulated nodes x 2 ranks (node n holds ranks 2n and 2n+1), each a process forked
from a forkserver that imported torch already. A controller (this process, the stand-in for the
agents) hosts a TCPStore for control and, by default, for the groups too (``--store host``);
with ``--store rank0`` each round's group gets a fresh TCPStore hosted by its new rank 0, as
elasticd's rounds do (``use_agent_store`` False). Every round's group uses a fresh prefix.

Modes (one victim node per run, rotating):

* ``kill``    SIGKILL of the victim's 2 ranks while every rank loops ``all_reduce`` (4 MiB).
* ``idle``    as ``kill``, but the kill lands while survivors "compute" (sleep between ops):
              does the next collective notice, and how fast? ``--late`` also makes rank 1
              compute longer than the kill + teardown of the others: does its collective on
              the old group end when the others have left it?
* ``freeze``  SIGSTOP of the victim's ranks during the loop. What ends the survivors'
              pending collective: ``--unstick none`` (the group timeout, ``--timeout``),
              ``abort`` / ``shutdown`` (``pg.abort()`` / ``pg.shutdown()`` called by a watcher
              thread when the controller says so), ``sockets`` (the watcher thread shuts down
              the group's own TCP sockets, found as the socket fds that init_process_group
              opened), ``asyncexc`` (PyThreadState_SetAsyncExc alone).

Survivors then tear the old group down (``--teardown destroy|abort|shutdown|sockets``; ``sockets`` shuts down the old group's own TCP sockets first, which ends the collective of every peer still blocked on this rank), report
"alive" to the controller, which assigns new ranks 0..3 in old-rank order (what an agent's
rendezvous round would hand them), and form a new group and run one all_reduce.

Output: one JSON line per run and a summary (medians), in ``--out``.

    flock /tmp/elasticd-cpu.lock .venv/bin/python bench/spikes/inprocess/gloo_reform.py \\
        --mode kill --runs 9 --out bench/results/spikes/inprocess_kill.json
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import sys
import threading
import time
import traceback

NODES, PER_NODE = 3, 2
WORLD = NODES * PER_NODE


def socket_fds() -> set[int]:
    """This process's socket descriptors."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                out.add(int(name))
        except OSError:
            pass
    return out


def shutdown_sockets(fds: set[int]) -> int:
    """shutdown(2) on each socket: a thread blocked on one of them wakes with EOF/error. The fd
    stays open (no reuse race with the thread that owns it)."""
    done = 0
    for fd in fds:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass
        finally:
            s.close()
    return done


def async_raise(thread_id: int, exc: type) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc))


class Reform(BaseException):
    """Raised into the training thread by the watcher."""


lingering: list = []


def worker(rank: int, args: dict, port: int, run: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rec: dict = {"rank": rank, "pid": os.getpid()}
    ctl = dist.TCPStore("127.0.0.1", port, is_master=False,
                        timeout=datetime.timedelta(seconds=60))
    timeout = datetime.timedelta(seconds=args["timeout"])

    def make_group(r: int, world: int, rnd: int) -> set[int]:
        before = socket_fds()
        if args["store"] == "host":
            store = dist.PrefixStore(f"run{run}/round{rnd}/", ctl)
        else:  # a fresh TCPStore per round on a port the controller chose, hosted by rank 0
            gport = int(ctl.get(f"run{run}/round{rnd}/port"))
            tcp = dist.TCPStore("127.0.0.1", gport, world_size=world, is_master=(r == 0),
                                timeout=datetime.timedelta(seconds=30), use_libuv=True)
            store = dist.PrefixStore(f"elasticd/round{rnd}/", tcp)
        dist.init_process_group("gloo", store=store, rank=r, world_size=world, timeout=timeout)
        return socket_fds() - before

    t0 = time.perf_counter()
    gloo_fds = make_group(rank, WORLD, 0)
    rec["init0_s"] = time.perf_counter() - t0
    rec["group_sockets"] = len(gloo_fds)
    held = {"pg": dist.group.WORLD}  # the only reference this script keeps to the group
    main_tid = threading.get_ident()
    unstick = args["unstick"]
    unstick_log: dict = {}

    def watcher() -> None:
        # A separate store connection: the main thread may be blocked in its own.
        wctl = dist.TCPStore("127.0.0.1", port, is_master=False,
                             timeout=datetime.timedelta(seconds=120))
        try:
            wctl.wait([f"run{run}/unstick"])
        except Exception:  # noqa: BLE001
            return
        t = time.time()
        unstick_log["at"] = t
        try:
            if unstick == "abort":
                held["pg"].abort()
            elif unstick == "shutdown":
                held["pg"].shutdown()
            elif unstick == "sockets":
                unstick_log["shut"] = shutdown_sockets(gloo_fds)
            unstick_log["call_s"] = time.time() - t
        except Exception as exc:  # noqa: BLE001
            unstick_log["error"] = repr(exc)[:200]
        if unstick in ("asyncexc",) or args.get("raise_after_unstick"):
            async_raise(main_tid, Reform)

    if args["mode"] == "freeze" and unstick != "none":
        threading.Thread(target=watcher, daemon=True).start()

    t = torch.ones(args["mb"] * (1 << 20) // 4)
    ctl.add(f"run{run}/ready", 1)
    ops = 0
    compute = args["compute"]
    late = args["late"] and rank == 1
    try:
        while True:
            if compute:
                # "compute": the op ends, then time passes with nothing pending.
                time.sleep(compute * (8 if late and ops >= 3 else 1))
            rec["last_op_start"] = time.time()
            dist.all_reduce(t)
            ops += 1
            rec["ops"] = ops
    except (Exception, Reform) as exc:  # noqa: BLE001
        rec["raised_at"] = time.time()
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    rec["unstick"] = unstick_log
    # Leave the old group.
    td = args["teardown"]
    t1 = time.perf_counter()
    pg = held.pop("pg")
    try:
        if td == "sockets":
            # Poison the old group for every peer still blocked in it: their pairs with this
            # rank see EOF/reset at once, raise, and do the same (a cascade along the ring).
            rec["shut_sockets"] = shutdown_sockets(gloo_fds)
        elif td == "abort":
            pg.abort()
        elif td == "shutdown":
            pg.shutdown()
        rec["teardown_call_s"] = time.perf_counter() - t1
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        rec["teardown_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    if args["linger"]:  # something still holds the old group (a DDP, a traceback's frame)
        lingering.append(pg)
    del pg
    rec["teardown_s"] = time.perf_counter() - t1
    # Tell the "agent", wait for the new assignment.
    ctl.set(f"run{run}/alive/{rank}", str(time.time()))
    t2 = time.perf_counter()
    new_rank, world = json.loads(ctl.get(f"run{run}/assign/{rank}"))
    rec["assign_wait_s"] = time.perf_counter() - t2
    t3 = time.perf_counter()
    try:
        make_group(new_rank, world, 1)
        rec["init1_s"] = time.perf_counter() - t3
        t4 = time.perf_counter()
        x = torch.ones(args["mb"] * (1 << 20) // 4)
        dist.all_reduce(x)
        rec["first_op_s"] = time.perf_counter() - t4
        rec["first_op_ok"] = bool(x[0].item() == world)
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        rec["reform_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    rec["done_at"] = time.time()
    ctl.set(f"run{run}/result/{rank}", json.dumps(rec))
    sys.stdout.flush()
    os._exit(0)  # docs/facts.md: teardown can SIGABRT at interpreter exit


def _entry(rank: int, args: dict, port: int, run: int) -> None:
    try:
        worker(rank, args, port, run)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        os._exit(3)


def _fresh(rank: int, world: int, port: int, key: str, mb: int) -> None:
    """Baseline: what the restart path pays for the same step, warm (a forked process that has
    torch imported, as elasticd's zygote gives): start, join a new group, one all_reduce."""
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        ctl = dist.TCPStore("127.0.0.1", port, is_master=False,
                            timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=dist.PrefixStore(key, ctl), rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=30))
        x = torch.ones(mb * (1 << 20) // 4)
        dist.all_reduce(x)
        ctl.set(f"{key}done/{rank}", str(time.time()))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        os._exit(3)
    os._exit(0)


def baseline(ctx, ctl, port: int, run: int, world: int, mb: int) -> float:
    """Seconds from starting ``world`` fresh warm processes to their first all_reduce done."""
    key = f"run{run}/fresh/"
    start = time.time()
    procs = [ctx.Process(target=_fresh, args=(r, world, port, key, mb)) for r in range(world)]
    for p in procs:
        p.start()
    ctl.wait([f"{key}done/{r}" for r in range(world)], datetime.timedelta(seconds=60))
    end = max(float(ctl.get(f"{key}done/{r}")) for r in range(world))
    for p in procs:
        p.join(10)
    return end - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(ctx, args: argparse.Namespace, ctl, port: int, run: int, victim: int) -> dict:
    conf = vars(args)
    procs = [ctx.Process(target=_entry, args=(r, conf, port, run), daemon=False)
             for r in range(WORLD)]
    if args.store == "rank0":
        ctl.set(f"run{run}/round0/port", str(free_port()))
        ctl.set(f"run{run}/round1/port", str(free_port()))
    for p in procs:
        p.start()
    out: dict = {"run": run, "victim_node": victim}
    try:
        ctl.wait([f"run{run}/ready"], datetime.timedelta(seconds=120))
        while int(ctl.add(f"run{run}/ready", 0)) < WORLD:
            time.sleep(0.01)
        time.sleep(args.warm)  # a few ops in flight
        victims = [victim * PER_NODE + i for i in range(PER_NODE)]
        survivors = [r for r in range(WORLD) if r not in victims]
        sig = signal.SIGSTOP if args.mode == "freeze" else signal.SIGKILL
        if args.mode == "idle":
            time.sleep(args.compute * 0.4)  # lands mid-"compute" of some op cycle
        t_kill = time.time()
        for r in victims:
            os.kill(procs[r].pid, sig)
        out["fault_at"] = t_kill
        if args.mode == "freeze" and args.unstick != "none":
            time.sleep(args.unstick_after)
            out["unstick_at"] = time.time()
            ctl.set(f"run{run}/unstick", "1")
        # The "agent": once every survivor said it left the old group, assign ranks.
        deadline = time.time() + args.timeout + 60
        while time.time() < deadline:
            if all(ctl.check([f"run{run}/alive/{r}"]) for r in survivors):
                break
            time.sleep(0.005)
        out["all_alive_at"] = time.time()
        for new, old in enumerate(survivors):
            ctl.set(f"run{run}/assign/{old}", json.dumps([new, len(survivors)]))
        recs = []
        for r in survivors:
            ctl.wait([f"run{run}/result/{r}"], datetime.timedelta(seconds=90))
            recs.append(json.loads(ctl.get(f"run{run}/result/{r}")))
        out["ranks"] = recs
        if args.baseline:
            out["baseline_fresh_group_s"] = baseline(ctx, ctl, port, run, len(survivors),
                                                     args.mb)
    except Exception as exc:  # noqa: BLE001
        out["controller_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for p in procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGKILL)
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        for p in procs:
            p.join(10)
        out["exitcodes"] = [p.exitcode for p in procs]
    return out


def summarise(runs: list[dict]) -> dict:
    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 4) if xs else None

    detect, teardown, init1, first, total, errors = [], [], [], [], [], set()
    for run in runs:
        for r in run.get("ranks", []):
            if "raised_at" in r:
                detect.append(r["raised_at"] - run.get("unstick_at", run["fault_at"]))
            teardown.append(r["teardown_s"])
            if "init1_s" in r:
                init1.append(r["init1_s"])
                first.append(r["first_op_s"])
            errors.add(r.get("error", "")[:80])
        if run.get("ranks") and all("done_at" in r for r in run["ranks"]):
            total.append(max(r["done_at"] for r in run["ranks"]) - run["fault_at"])
    fresh = [r["baseline_fresh_group_s"] for r in runs if "baseline_fresh_group_s" in r]
    return {"runs": len(runs),
            "baseline_fresh_warm_group_s": {"median": med(fresh)},
            "reformed": sum(1 for r in runs if r.get("ranks") and all(
                x.get("first_op_ok") for x in r["ranks"])),
            "raise_after_fault_or_unstick_s": {"median": med(detect),
                                               "max": round(max(detect), 4) if detect else None},
            "teardown_s": {"median": med(teardown), "max": round(max(teardown), 4)
                           if teardown else None},
            "new_group_init_s": {"median": med(init1), "max": round(max(init1), 4)
                                 if init1 else None},
            "first_collective_s": {"median": med(first)},
            "fault_to_all_reformed_s": {"median": med(total),
                                        "max": round(max(total), 4) if total else None},
            "errors_seen": sorted(errors)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["kill", "idle", "freeze"], default="kill")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--teardown", choices=["destroy", "abort", "shutdown", "sockets"],
                    default="destroy")
    ap.add_argument("--unstick", choices=["none", "abort", "shutdown", "sockets", "asyncexc"],
                    default="none")
    ap.add_argument("--raise-after-unstick", action="store_true",
                    help="the watcher also raises Reform in the main thread after unsticking")
    ap.add_argument("--unstick-after", type=float, default=0.5)
    ap.add_argument("--store", choices=["host", "rank0"], default="host")
    ap.add_argument("--timeout", type=float, default=30.0, help="gloo group timeout, s")
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--compute", type=float, default=0.0)
    ap.add_argument("--late", action="store_true")
    ap.add_argument("--baseline", action="store_true",
                    help="per run, also time fresh warm processes forming the same group")
    ap.add_argument("--linger", action="store_true",
                    help="keep a reference to the old group after tearing it down")
    ap.add_argument("--warm", type=float, default=1.0)
    ap.add_argument("--victim", type=int, default=-1, help="node to fault; -1 rotates")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    import torch.distributed as dist

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    port = free_port()
    ctl = dist.TCPStore("127.0.0.1", port, is_master=True,
                        timeout=datetime.timedelta(seconds=120), use_libuv=True)
    runs = []
    for run in range(args.runs):
        victim = args.victim if args.victim >= 0 else run % NODES
        res = one_run(ctx, args, ctl, port, run, victim)
        print(json.dumps(res), flush=True)
        runs.append(res)
    summary = summarise(runs)
    print(json.dumps(summary, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump({"command": " ".join(sys.argv), "args": vars(args), "summary": summary,
                       "runs": runs}, fh, indent=1)


if __name__ == "__main__":
    main()
