"""A ZeroRedundancyOptimizer's snapshot loads at another world size: each rank's shard is
saved with its partition map (the global index of each of its parameters), and a rank of the
new world assembles its new partition's Adam state from every old rank's shard. Checked 3 → 2
and 2 → 3 (parameter sizes not divisible by 2 or 3; the partitions differ) against the
standard way, ``consolidate_state_dict`` at the old world size and
``ZeroRedundancyOptimizer.load_state_dict`` at the new one, bit for bit. Real torch: ranks are
processes spawned here (gloo on 127.0.0.1); snapshots go through :func:`flatten` and
:func:`load_into` (the daemon's part is test_store_peer_restore's and the chaos test's).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from elasticd.coordination.embedded import free_port
from tests.ranks import spawn

DIMS = (7, 5, 11, 4, 3)


def _build():
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    layers = []
    for a, b in zip(DIMS, DIMS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    model = DDP(torch.nn.Sequential(*layers[:-1]))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                  lr=0.01)
    return model, opt


def _local(opt):
    """This rank's Adam state by global parameter index, and the groups' hyper-parameters."""
    index = opt._param_to_index
    owned = [index[p] for g in opt.optim.param_groups for p in g["params"]]
    out = {}
    for i, st in opt.optim.state_dict()["state"].items():
        for k, v in st.items():
            out[f"{owned[i]}/{k}"] = v.clone()
    hyper = [{k: v for k, v in g.items() if k != "params"}
             for gs in (opt.param_groups, opt.optim.param_groups) for g in gs]
    return owned, out, json.dumps(hyper)


def _rank_main(rank, world, port, out_dir, phase, old_world):
    """``save``: train 3 steps and snapshot; ``load``: restore the old world's snapshots
    (first with one old shard missing: refused), check, then the same as ``save``."""
    import torch.distributed as dist

    from elasticd.worker.state import StateMismatch, flatten, load_into

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model, opt = _build()
        state = {"model": model, "optim": opt}
        if phase == "load":
            snaps = [torch.load(os.path.join(out_dir, f"w{old_world}-{q}.pt"),
                                weights_only=True) for q in range(old_world)]
            base = rank % old_world
            others = [(s["names"], s["tensors"], json.loads(s["meta"]))
                      for q, s in enumerate(snaps) if q != base]
            mine = snaps[base]
            with pytest.raises(StateMismatch, match="shards fetched hold"):  # one missing
                load_into(state, mine["tensors"], json.loads(mine["meta"]),
                          names=mine["names"], others=others[:-1])
            load_into(state, mine["tensors"], json.loads(mine["meta"]), names=mine["names"],
                      others=others)
            _check(opt, rank, world, old_world, out_dir)
        for step in range(3):  # then train on, and snapshot, at this world size
            g = torch.Generator().manual_seed(100 * step + rank)
            model(torch.randn(4, DIMS[0], generator=g)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        flat = flatten(state)
        torch.save({"names": flat.names, "tensors": [t.clone() for t in flat.tensors],
                    "meta": json.dumps(flat.meta)}, os.path.join(out_dir, f"w{world}-{rank}.pt"))
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            torch.save(opt.state_dict(), os.path.join(out_dir, f"w{world}-consolidated.pt"))
    finally:
        dist.destroy_process_group()


def _check(opt, rank, world, old_world, out_dir):
    """This rank's optimizer equals, bitwise, the consolidated state loaded at this world."""
    ref_model, ref_opt = _build()
    ref_opt.load_state_dict(torch.load(
        os.path.join(out_dir, f"w{old_world}-consolidated.pt"), weights_only=True))
    got, want = _local(opt), _local(ref_opt)
    assert got[0] == want[0] and got[2] == want[2]
    assert got[1].keys() == want[1].keys() and got[1], (got[1].keys(), want[1].keys())
    for k, t in want[1].items():
        assert torch.equal(got[1][k].reshape(-1).view(torch.uint8),
                           t.reshape(-1).view(torch.uint8)), f"{old_world}->{world} {rank}: {k}"
    with open(os.path.join(out_dir, f"owned-{world}-{rank}"), "w") as f:
        json.dump(got[0], f)


@pytest.mark.slow
def test_zero_shards_reshard_3_to_2_to_3_like_consolidate_and_load(tmp_path):
    out = str(tmp_path)
    owned = {}
    for old, new in ((0, 3), (3, 2), (2, 3)):
        spawn(_rank_main, args=(new, free_port(), out, "load" if old else "save", old),
                 nprocs=new)
        if old:
            owned[new] = [json.load(open(os.path.join(out, f"owned-{new}-{r}")))
                          for r in range(new)]
            assert sorted(i for o in owned[new] for i in o) == list(range(2 * (len(DIMS) - 1)))
    # The partitions differ: some rank of each new world owns parameters two old ranks held.
    assert owned[2] != owned[3][:2], owned
