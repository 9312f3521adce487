"""A data-parallel job whose Adam state is sharded across ranks by ``ZeroRedundancyOptimizer``
(each rank holds the state of its partition of the parameters, whole parameters assigned by
size), gloo on CPU, an ``elasticd.Checkpointer`` snapshotting every step. Layer widths are not
divisible by 2 or 3, and the partition of the parameters differs between world sizes 2 and 3.

Only the lines marked "test:" are not what a user writes:

* the lines tests/chaos/harness.py parses (``start``, ``step``, ``done``) and the sample log;
* ``--ref-dir``: from step ``--ref-from`` on, every step the optimizer state is consolidated
  the standard way (``consolidate_state_dict(to=0)``) and rank 0 saves it with the model's
  state dict to ``DIR/<attempt>/<step>.pt`` (before the Checkpointer's snapshot of that step,
  so a committed step always has its twin): the independent reference the chaos test loads at
  the new world size (tests/integration/workers/zero_reference.py);
* right after a restore, every rank dumps what it restored (:func:`local_state`) to
  ``DIR/restored/<attempt>-rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import elasticd
from elasticd.worker import progress

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_trainer import WIDTHS, Data  # noqa: E402  (the same data; a DDP model here)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return DDP(torch.nn.Sequential(*layers[:-1]), find_unused_parameters=True)


def make_optimizer(model: torch.nn.Module) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)


def local_state(model: torch.nn.Module, opt: ZeroRedundancyOptimizer) -> dict:
    """test: this rank's model, its ZeRO shard's state (by global parameter index, cloned) and
    the wrapper's and the shard's param-group hyper-parameters."""
    index = opt._param_to_index
    owned = [index[p] for g in opt.optim.param_groups for p in g["params"]]
    local = opt.optim.state_dict()
    tensors = {f"model/{k}": v.detach().clone() for k, v in model.module.state_dict().items()}
    for i, st in local["state"].items():
        for k, v in st.items():
            tensors[f"optim/{owned[i]}/{k}"] = v.detach().clone()
    hyper = [[{k: v for k, v in g.items() if k != "params"} for g in groups]
             for groups in (opt.param_groups, opt.optim.param_groups)]
    return {"tensors": tensors, "owned": owned, "groups": json.loads(json.dumps(hyper))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--sample-log", default="")
    p.add_argument("--out", default="")
    p.add_argument("--ref-dir", default="")
    p.add_argument("--ref-from", type=int, default=1)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    t = torch.tensor([time.time_ns()], dtype=torch.int64)  # test: an id of this process group
    dist.broadcast(t, 0)
    attempt = int(t.item())

    data = Data()
    sampler = elasticd.ElasticSampler(len(data), shuffle=True, seed=0, pad=False)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler,
                        generator=torch.Generator().manual_seed(0))
    model = make_model()
    opt = make_optimizer(model)
    state = {"model": model, "optim": opt, "sampler": sampler, "rng": elasticd.RNGState(),
             "epoch": 0}
    ckpt = elasticd.Checkpointer(every=1)
    step = ckpt.restore(state)
    epoch = state["epoch"]
    r = ckpt.last_restore
    if args.ref_dir and step > 0:  # test: what was restored, before any training touches it
        dump = local_state(model, opt) | {
            "step": step, "world": world, "rank": rank, "attempt": attempt,
            "source": r.source if r else "none", "saved_world": r.saved_world_size if r else 0}
        os.makedirs(os.path.join(args.ref_dir, "restored"), exist_ok=True)
        path = os.path.join(args.ref_dir, "restored", f"{attempt}-rank{rank}.pt")
        torch.save(dump, path + ".tmp")
        os.replace(path + ".tmp", path)
    print(f"start rank {rank} world {world} restart {restart} pid {os.getpid()} "
          f"restored step {step} from {r.source if r else 'none'} "
          f"in {r.seconds if r else 0:.3f} s, steps lost {r.steps_lost if r else 0}", flush=True)

    samples = None
    if args.sample_log:
        os.makedirs(args.sample_log, exist_ok=True)
        samples = open(os.path.join(args.sample_log,
                                    f"samples-{attempt}-rank{rank}-{os.getpid()}.jsonl"),
                       "a", buffering=1)
    while step < args.steps:
        sampler.set_epoch(epoch)
        state["epoch"] = epoch
        for x, y, index in loader:
            if step >= args.steps:
                break
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if args.ref_dir and step >= args.ref_from:  # test: the independent reference
                opt.consolidate_state_dict(to=0)
                if rank == 0:
                    directory = os.path.join(args.ref_dir, str(attempt))
                    os.makedirs(directory, exist_ok=True)
                    path = os.path.join(directory, f"{step}.pt")
                    torch.save({"model": model.module.state_dict(), "optim": opt.state_dict()},
                               path + ".tmp")
                    os.replace(path + ".tmp", path)
            if samples is not None:
                samples.write(json.dumps({"attempt": attempt, "rank": rank, "world": world,
                                          "step": step, "epoch": epoch,
                                          "t": round(time.time(), 4),
                                          "indices": index.tolist()}) + "\n")
            ckpt.save(step, state)
            progress(step)
            print(f"step {step} world {world} rank {rank} restart {restart} "
                  f"loss {loss.item():.5f}", flush=True)
            if args.step_time:
                time.sleep(args.step_time)
        epoch += 1

    ckpt.close()
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save({k: v.clone() for k, v in model.module.state_dict().items()},
                   os.path.join(args.out, "final.pt"))
    print(f"done rank {rank} world {world} steps {step}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # docs/facts.md: avoids a rare SIGABRT after destroy_process_group


if __name__ == "__main__":
    sys.exit(main())
