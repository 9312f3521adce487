"""Issue 31: what keeps a process's first FSDP2 round's group alive (torch 2.13, gloo, world 1).

DTensor's caches key on specs holding the round's DeviceMesh, whose equality ignores its group:
the fast-path sharding cache (C++), the redistribute planners, _gen_transform_infos and
MeshTopoInfo.build_from_mesh. Round 0 fills them; a later round of the same layout hits round
0's entries and caches nothing, so only round 0's mesh -> group -> store sockets stay. Prints,
at each round's leave, how many of its sockets are still open and which rounds' groups live.
`--save` flattens each round's state twice as a Checkpointer's saves do (elasticd's own holds:
shards' layout caches, keyed the same way, and the flatten memo); `--clear` leaves as
elasticd.worker.in_process does (dtensor_caches.forget): all are released.
    .venv/bin/python bench/spikes/inprocess/fsdp_first_round.py [--save] [--clear]"""
import datetime, gc, os, socket, sys, weakref
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from elasticd.worker import dtensor_caches, snapshot_plan  # noqa: E402
from elasticd.worker.in_process import _socket_fds as fds  # noqa: E402
held, planner = [], snapshot_plan.Planner("job")  # a Checkpointer's: its memo and shards' caches
for rnd in range(3):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    before = fds()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"r{rnd}/", store), rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8)).sum().backward(); opt.step()
    [planner.flatten({"model": model, "optim": opt}) for _ in range(2 * ("--save" in sys.argv))]
    held.append((weakref.ref(dist.group.WORLD), fds() - before))
    del model, opt, layer, store
    dist.destroy_process_group()
    "--clear" in sys.argv and dtensor_caches.forget()
    gc.collect()
    print(f"round {rnd} left: its sockets still open {len(held[-1][1] & fds())}; groups of "
          f"rounds 0..{rnd} alive {[g() is not None for g, _ in held]}")
