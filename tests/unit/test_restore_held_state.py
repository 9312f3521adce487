"""A survivor whose live state still is the step every rank agrees on loads nothing (issue 31,
``elasticd/worker/held_state.py``); one whose state moved since its last snapshot, on any rank,
makes every rank load it as before.

A real CheckpointService (one node's RAM) through the in-process transport, ranks as threads
(the harness of test_restore_own_shard.py): three ranks save steps 1..5 at world 3, rank 1
"dies", ranks 0 and 2 restore as ranks 0 and 1 of world 2. The state is parameters and an
optimizer only (what ``optimizer.step`` alone changes); a BatchNorm state is always loaded.
"""

from __future__ import annotations

import pytest
import torch

from elasticd.local import worker_link as link
from elasticd.testing.transport import InProcessTransport
from elasticd.worker.checkpointer import Checkpointer
from tests.unit.test_restore_own_shard import _reform
from tests.unit.test_worker_checkpointer import service  # noqa: F401 — a fixture


@pytest.fixture(autouse=True)
def _in_process(monkeypatch):
    """Ranks as an in-process agent's workers (their link set): only those mark their saves."""
    monkeypatch.setenv(link.LINK_ENV, "held-state-test")


def _state(norm: bool = False) -> dict:
    torch.manual_seed(0)  # the same replica on every rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 8),
                                *([torch.nn.BatchNorm1d(8)] if norm else []),
                                torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=0.01)}


def _capture(state: dict) -> dict:
    return {"model": {k: v.clone() for k, v in state["model"].state_dict().items()},
            "optim": [{k: v.clone() for k, v in s.items()}
                      for s in state["optim"].state_dict()["state"].values()],
            "lr": state["optim"].param_groups[0]["lr"]}


def _same_model(state: dict, ref: dict) -> bool:
    got = _capture(state)
    return all(v.equal(got["model"][k]) for k, v in ref["model"].items()) and all(
        all(a[k].equal(b[k]) for k in b) for a, b in zip(got["optim"], ref["optim"]))


def _forward_backward(state: dict, step: int) -> None:
    torch.manual_seed(step)
    state["model"](torch.randn(4, 6)).pow(2).sum().backward()


def _train(state: dict, step: int) -> None:
    _forward_backward(state, step)
    state["optim"].step()
    state["optim"].zero_grad()


def _run(service, after, norm=False):  # noqa: F811 — the fixture's value
    """Saves steps 1..5 on three ranks, applies ``after(state)`` to rank 2's state (what ran
    between its last snapshot and its group's failure), re-forms ranks 0 and 2 at world 2.
    Returns the restore results, the ``ckpt_open`` calls, the states and step 5's state."""
    handlers = service.handlers()
    opens = []
    opened = handlers["ckpt_open"]
    handlers["ckpt_open"] = lambda msg: opens.append(msg.get("rank")) or opened(msg)
    t = InProcessTransport(handlers)
    ckpts = [Checkpointer(transport=t, job="j", rank=r, world_size=3) for r in range(3)]
    try:
        states = [_state(norm) for _ in range(3)]
        for step in range(1, 6):
            for ckpt, state in zip(ckpts, states):
                _train(state, step)
                ckpt.save(step, state)
                ckpt.wait()
        ref = _capture(states[0])
        after(states[2])
        results = _reform([ckpts[0], ckpts[2]], [states[0], states[2]], world=2)
        return results, opens, [states[0], states[2]], ref
    finally:
        for ckpt in ckpts:
            ckpt.close()


def _in_place(state):
    with torch.no_grad():
        state["model"][0].weight.add_(1.0)


def test_survivors_whose_memory_is_the_agreed_step_load_nothing(service):  # noqa: F811
    results, opens, states, ref = _run(service, lambda state: None)
    assert [step for step, _ in results] == [5, 5]
    assert all(res.in_memory and res.source == "local" and res.nbytes == 0
               for _, res in results), results
    assert opens == []  # on the old code each survivor opened its own slot
    assert all(_same_model(state, ref) for state in states)


@pytest.mark.parametrize("after", [
    lambda state: _train(state, 6),  # its optimizer stepped: the failure came after it
    _in_place,  # a parameter written in place
    lambda state: state["optim"].param_groups[0].update(lr=0.5),  # meta: a scheduler's lr
], ids=["optimizer-step", "in-place-write", "lr-changed"])
def test_a_state_moved_since_its_snapshot_is_loaded_on_every_rank(service, after):  # noqa: F811
    results, opens, states, ref = _run(service, after)
    assert [step for step, _ in results] == [5, 5]
    assert not any(getattr(res, "in_memory", False) for _, res in results)
    assert sorted(opens) == [0, 2]  # each survivor's own slot, as before
    assert all(_same_model(state, ref) for state in states)  # step 5 again, bitwise
    assert states[1]["optim"].param_groups[0]["lr"] == ref["lr"]


def test_a_state_with_buffers_is_always_loaded(service):  # noqa: F811
    results, opens, _, _ = _run(service, lambda state: None, norm=True)
    assert [step for step, _ in results] == [5, 5]
    assert not any(getattr(res, "in_memory", False) for _, res in results)
    assert sorted(opens) == [0, 2]
