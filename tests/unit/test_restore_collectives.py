"""The restore's agreement flags in one collective each, on a real 2-rank gloo group.

After a re-formation every collective of the restore waits for the slowest rank: the two
flags after the fetch (every daemon answered, every rank has its bytes) were two all_reduces,
and "every rank loaded" plus the replicas' digests an all_reduce and an all_gather. Each pair
is one collective now (:meth:`TorchCollective.all_true_each`,
:meth:`TorchCollective.gather_if_all_true`), with the same answers on every rank; a
:class:`Collective` that gives only ``all_gather`` (a test's simulated ranks) has both too.
"""

from __future__ import annotations

import json
import os

from elasticd.coordination.embedded import free_port
from tests.ranks import spawn


def _rank(rank: int, port: int, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from elasticd.worker import restore as r

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    calls = []
    for name in ("all_reduce", "all_gather"):
        real = getattr(dist, name)
        setattr(dist, name, lambda *a, _real=real, _name=name, **k: calls.append(_name)
                or _real(*a, **k))
    c = r.TorchCollective()
    seen: dict = {}
    seen["both"] = c.all_true_each([True, True])
    seen["one_false"] = c.all_true_each([True, rank == 0])
    seen["flags_calls"] = list(calls)
    calls.clear()
    seen["rows"] = c.gather_if_all_true(True, [(rank, 7), (5, rank)])
    seen["refused"] = c.gather_if_all_true(rank == 1, [(rank, 7)])
    seen["gather_calls"] = list(calls)
    # the restore's own use: digests of replicated entries, with a load error on one rank
    calls.clear()
    model = torch.nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.fill_(1.0 + rank)  # differ across ranks
    seen["differ"] = r._loaded_everywhere({"model": model}, ["model"], c, "")
    seen["error"] = r._loaded_everywhere({"model": model}, ["model"], c,
                                         "bad shape" if rank == 1 else "")
    seen["load_calls"] = list(calls)
    # A Collective that gives only all_gather has the rest from the base class, same answers.
    calls.clear()

    class Gathers(r.Collective):
        def all_gather(self, rows):
            return c.all_gather(rows)

    g = Gathers()
    seen["base"] = [g.all_true_each([True, rank == 0]), g.all_true(rank == 0),
                    g.gather_if_all_true(True, [(rank, 7)]), g.gather_if_all_true(rank == 1, [])]
    seen["base_calls"] = list(calls)
    # A handover over the real group: rank 0 sends its bytes point to point, then "nothing".
    from elasticd.worker import handover

    plan = handover.Handover((0, 5), ((0, 1),))
    mine = torch.arange(300, dtype=torch.int64).to(torch.uint8) if rank == 0 else None
    got = handover.exchange(plan, rank, mine, c)
    seen["handed"] = None if got is None else got.tolist()[:4] + [got.numel()]
    seen["handed_none"] = handover.exchange(plan, rank, None, c) is None
    with open(os.path.join(out, f"{rank}.json"), "w") as fh:
        json.dump(seen, fh)
    dist.destroy_process_group()


def test_two_flags_and_the_load_check_take_one_collective_each(tmp_path):
    spawn(_rank, (free_port(), str(tmp_path)), nprocs=2)
    seen = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    for rank, got in enumerate(seen):
        assert got["both"] == [True, True]
        assert got["one_false"] == [True, False]  # rank 1's second flag was False
        assert got["flags_calls"] == ["all_reduce", "all_reduce"]  # one per all_true_each
        assert got["rows"] == [[[0, 7], [5, 0]], [[1, 7], [5, 1]]]
        assert got["refused"] is None  # rank 0's flag was False: None on both
        assert got["gather_calls"] == ["all_gather", "all_gather"]
        assert got["differ"] == ["model"]
        assert got["error"] is None  # rank 1 could not load: None on both
        assert got["load_calls"] == ["all_gather", "all_gather"]
        assert got["base"] == [[True, False], False, [[[0, 7]], [[1, 7]]], None]
        assert got["base_calls"] == ["all_gather"] * 4  # one collective per question
        assert got["handed"] == [0, 1, 2, 3, 300]  # the holder's own, and what rank 1 got
        assert got["handed_none"]  # a holder with nothing to give: the receiver gets None
