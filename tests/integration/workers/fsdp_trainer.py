"""An FSDP2 training job written from docs/worker-api.md's "Sharded training" section (and
examples/train_fsdp.py): parameters and Adam state sharded across every rank (``fully_shard``
over the whole world, DTensor), gloo on CPU, an ``elasticd.Checkpointer`` snapshotting every
step. Layer widths are not divisible by 2 or 3, so FSDP2's shards are uneven at either world
size (the last layer has one row: at world 3 two ranks hold none of it).

Only the lines marked "test:" are not what a user writes:

* the lines tests/chaos/harness.py parses (``start``, ``step``, ``done``) and the sample log;
* ``--dcp-dir``: from step ``--dcp-from`` on, every step is also saved with the standard
  ``dcp.save(get_state_dict(model, optim))`` into ``DIR/<attempt>/<step>`` (before the
  Checkpointer's snapshot of that step, so a committed step always has its DCP twin): the
  independent reference the chaos test loads with ``dcp.load`` at the new world size;
* right after a restore, every rank dumps what it restored (its local shards of the model and
  the optimizer state, as ``get_state_dict`` gives them) to ``DIR/restored/<attempt>-rank<r>.pt``.

Usage: ``torchrun ... fsdp_trainer.py --steps S --step-time T --sample-log DIR --out DIR
[--dcp-dir DIR --dcp-from N]``. tests/integration/workers/fsdp_dcp_reference.py builds the
same model (:func:`make_model`) to load the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

import elasticd
from elasticd.worker import progress

WIDTHS = (32, 37, 41, 29, 23, 19, 13, 7, 1)  # 8 Linear layers; no row count divisible by 2 or 3
N = 4096  # samples (tests/chaos/harness.py's sample check assumes this many)


class Data(Dataset):
    """A fixed regression set whose items carry their index (test: for the sample log)."""

    def __init__(self, n: int = N) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, WIDTHS[0], generator=g)
        w = torch.randn(WIDTHS[0], 1, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def make_model() -> torch.nn.Module:
    """The model, each Linear and the root ``fully_shard``-ed over the default process group."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1])
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def local_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """test: this rank's part of ``get_state_dict(model, opt)``: every DTensor's local shard
    (cloned), every plain tensor, and the param groups' hyper-parameters."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    tensors = {}
    for k, v in msd.items():
        tensors[f"model/{k}"] = (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim/{fqn}/{k}"] = (v.to_local() if hasattr(v, "to_local")
                                               else v).detach().clone()
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": sorted(g["params"])}
              for g in osd["param_groups"]]
    return {"tensors": tensors, "groups": json.loads(json.dumps(groups))}


def _attempt_id() -> int:
    """test: an id every rank of this process group shares (rank 0's start time)."""
    t = torch.tensor([time.time_ns()], dtype=torch.int64)
    dist.broadcast(t, 0)
    return int(t.item())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--sample-log", default="")
    p.add_argument("--out", default="")
    p.add_argument("--dcp-dir", default="")
    p.add_argument("--dcp-from", type=int, default=1)
    p.add_argument("--resume", default="",
                   help="a DCP save of this trainer (with its sampler.json) to start from, "
                        "without elasticd: bench/loss_curves.py's failure-free reference")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # 1. the process group
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    attempt = _attempt_id()

    data = Data()
    # 2. the sampler, then the loader
    sampler = elasticd.ElasticSampler(len(data), shuffle=True, seed=0, pad=False)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler,
                        generator=torch.Generator().manual_seed(0))
    model = make_model()  # 3. fully_shard, then the optimizer over the sharded parameters
    opt = make_optimizer(model)

    # 4. restore: resharded from the old ranks' snapshots when the world size changed
    state = {"model": model, "optim": opt, "sampler": sampler, "rng": elasticd.RNGState(),
             "epoch": 0}
    ckpt = elasticd.Checkpointer(every=1)
    step = ckpt.restore(state)
    epoch = state["epoch"]
    if args.resume:  # bench: a failure-free segment at another world size, plain dcp.load
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=args.resume)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        with open(os.path.join(args.resume, "sampler.json")) as fh:
            saved = json.load(fh)
        sampler.load_state_dict(saved["sampler"])
        step, epoch = int(saved["step"]), int(saved["epoch"])
    r = ckpt.last_restore
    if args.dcp_dir and step > 0:  # test: what was restored, before any training touches it
        dump = local_state(model, opt) | {
            "step": step, "world": world, "rank": rank, "attempt": attempt,
            "source": r.source if r else "none", "saved_world": r.saved_world_size if r else 0}
        os.makedirs(os.path.join(args.dcp_dir, "restored"), exist_ok=True)
        path = os.path.join(args.dcp_dir, "restored", f"{attempt}-rank{rank}.pt")
        torch.save(dump, path + ".tmp")
        os.replace(path + ".tmp", path)
    print(f"start rank {rank} world {world} restart {restart} pid {os.getpid()} "
          f"restored step {step} from {r.source if r else 'none'} "
          f"in {r.seconds if r else 0:.3f} s, steps lost {r.steps_lost if r else 0}", flush=True)

    samples = None
    if args.sample_log:  # test: each step's sample indices, for the harness
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
            if args.dcp_dir and step >= args.dcp_from:  # test: the independent reference
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint.state_dict import get_state_dict

                msd, osd = get_state_dict(model, opt)
                where = os.path.join(args.dcp_dir, str(attempt), str(step))
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
                if rank == 0:  # the data position too, for --resume (one for all ranks)
                    with open(os.path.join(where, "sampler.json"), "w") as fh:
                        json.dump({"step": step, "epoch": epoch,
                                   "sampler": sampler.state_dict()}, fh)
            if samples is not None:
                samples.write(json.dumps({"attempt": attempt, "rank": rank, "world": world,
                                          "step": step, "epoch": epoch,
                                          "t": round(time.time(), 4), "loss": loss.item(),
                                          "indices": index.tolist()}) + "\n")
            ckpt.save(step, state)
            progress(step)
            print(f"step {step} world {world} rank {rank} restart {restart} "
                  f"loss {loss.item():.5f}", flush=True)
            if args.step_time:
                time.sleep(args.step_time)
        epoch += 1

    ckpt.close()
    if args.out:  # every rank takes part in the gather; rank 0 writes the full weights
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save(full, os.path.join(args.out, "final.pt"))
    print(f"done rank {rank} world {world} steps {step}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # docs/facts.md: avoids a rare SIGABRT after destroy_process_group


if __name__ == "__main__":
    sys.exit(main())
