"""The parts the worker's Checkpointer owns, each alone: the slot mappings it keeps
(:mod:`elasticd.worker.slot_maps`), the optimizer fence (:mod:`elasticd.worker.optimizer_fence`),
the snapshot plan (:mod:`elasticd.worker.snapshot_plan`) and its log notices
(:class:`elasticd.worker.checkpointer.Notices`). The Checkpointer itself: test_worker_checkpointer.py."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from elasticd.snapshot.segment import PAGE
from elasticd.worker.copier import CpuCopier
from elasticd.worker.checkpointer import Notices
from elasticd.worker.optimizer_fence import OptimizerFence
from elasticd.worker.slot_maps import SlotMaps
from elasticd.worker.snapshot_plan import Planner, sync_mask


def _slot(capacity: int = PAGE) -> dict:
    fd = os.memfd_create("slot")
    os.ftruncate(fd, capacity)
    st = os.fstat(fd)
    return {"capacity": capacity, "_fds": [fd], "file": [st.st_dev, st.st_ino]}


def test_the_two_newest_slots_stay_mapped_and_a_known_file_needs_no_descriptor():
    maps = SlotMaps(CpuCopier())
    first, second, third = _slot(), _slot(), _slot()
    keys = [first["file"], second["file"], third["file"]]
    a = maps.map(first)
    assert maps.map({"capacity": PAGE, "file": keys[0]}) is a  # no descriptor: the same map
    maps.map(second)
    maps.map(third)  # double buffering: the oldest goes
    assert maps.mapped() == keys[1:]
    with pytest.raises(RuntimeError, match="no descriptor"):
        maps.map({"capacity": PAGE, "file": keys[0]})
    with pytest.raises(RuntimeError, match="no descriptor"):
        maps.map({"capacity": 2 * PAGE, "file": keys[2]})  # grown: a new file is due
    maps.close()
    assert maps.mapped() == []


class _Copy:
    def __init__(self) -> None:
        self.finished = threading.Event()
        self.waiting = threading.Event()

    def done(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout: float) -> None:
        self.waiting.set()
        self.finished.wait(timeout)

    def finish_after(self, seconds: float) -> threading.Thread:
        """Finishes the copy ``seconds`` after a hook starts waiting for it (not after the test
        starts: a loaded machine may take longer than that for the forward and backward)."""
        def run() -> None:
            if self.waiting.wait(10.0):
                threading.Event().wait(seconds)
            self.finished.set()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def test_an_optimizer_step_waits_for_the_copy_in_flight():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    waits: list[float] = []
    fence = OptimizerFence(timeout=5.0, on_wait=waits.append)
    fence.watch({"model": model, "opt": opt})
    fence.watch({"opt": opt})  # hooked once
    fence.copy = copy = _Copy()
    finisher = copy.finish_after(0.2)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    finisher.join(5.0)
    assert copy.done() and len(waits) == 1 and waits[0] >= 0.15
    assert fence.take_stall() == waits[0] and fence.take_stall() == 0.0
    opt.step()  # the copy is done: no wait
    fence.close()
    fence.copy = _Copy()  # never finishes: no hook holds the step any more
    opt.step()
    assert len(waits) == 1


def test_an_optimizer_made_again_is_hooked_even_with_the_id_of_a_gone_one():
    # Under @elasticd.in_process a ZeRO or FSDP2 optimizer is made for each round, and CPython
    # often gives the new one the id of the last, gone since: it was taken for hooked, and its
    # step ran while the copy still read the parameters (a torn snapshot).
    import gc

    model = torch.nn.Linear(2, 2)
    waits: list[float] = []
    fence = OptimizerFence(timeout=0.01, on_wait=waits.append)
    def a_round() -> int:  # an optimizer watched, then gone: its id
        gone = torch.optim.SGD(model.parameters(), lr=0.1)
        fence.watch({"optim": gone})
        return id(gone)

    seen: set[int] = set()
    for _ in range(100):
        seen.add(a_round())
        gc.collect()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if id(opt) in seen:
            break
    else:
        pytest.skip("no optimizer took a gone one's id")
    fence.watch({"optim": opt})
    fence.copy = _Copy()  # never finishes: a hooked step waits (the timeout), then goes
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert len(waits) == 1
    fence.close()


def test_a_restore_drops_the_gradients_of_an_interrupted_step():
    # A survivor re-entering its function under @elasticd.in_process kept the gradients of the
    # step its group broke in; the next backward added to them and DDP averaged both, so its
    # losses left a failure-free run's from the second step after the resume
    # (bench/results/loss_curves_inprocess_ddp_before_grad_fix.json, 184 of 1970 equal).
    from elasticd.worker.checkpointer import Checkpointer

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    with Checkpointer(transport=None) as ckpt:
        assert ckpt.restore({"model": model, "optim": opt}) == 0
    assert all(p.grad is None for p in model.parameters())


def test_a_plan_is_kept_while_the_state_keeps_its_shape():
    model = torch.nn.BatchNorm1d(3)
    planner = Planner("job")
    assert not planner.checked
    state = {"model": model, "loose": torch.zeros(2)}
    plan = planner.plan_for(planner.flatten(state), state)
    assert planner.checked and planner.current is plan
    assert planner.plan_for(planner.flatten(state), state) is plan
    mask = dict(zip(planner.flatten(state).names, plan.sync_mask))
    assert not mask["model/weight"] and not mask["model/bias"]  # only optimizer.step changes
    assert mask["model/running_mean"] and mask["loose"]  # the next forward may change these
    plan.stale = True  # the meta outgrew its reserve
    assert planner.plan_for(planner.flatten(state), state) is not plan
    grown = {"model": model, "loose": torch.zeros(3)}
    assert planner.plan_for(planner.flatten(grown), grown).key != plan.key
    assert sync_mask({}, ["x"]) == (True,)


def test_unprotected_is_said_once_a_minute_and_protected_again_once(caplog):
    notices = Notices("job j rank 0")
    with caplog.at_level(logging.WARNING, logger="elasticd.checkpoint"):
        notices.once("k", "first")
        notices.once("k", "again")
        for now in (0.0, 30.0, 59.0):
            notices.heard({"unprotected": "UNPROTECTED: x"}, now)
        notices.heard({"unprotected": "UNPROTECTED: y"}, 59.5)  # another reason: at once
        notices.heard({"unprotected": "UNPROTECTED: y"}, 120.0)
        notices.heard(None, 121.0)  # no reply: nothing said
        notices.heard({}, 122.0)
        notices.heard({}, 123.0)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["elasticd: first", "elasticd: job j rank 0: UNPROTECTED: x",
                    "elasticd: job j rank 0: UNPROTECTED: y",
                    "elasticd: job j rank 0: UNPROTECTED: y",
                    "elasticd: job j rank 0 is protected again"]
