"""FSDP2 on 3 nodes, really sharded (``fully_shard`` over a world of 3: each rank holds a third
of every parameter and of Adam's state), replication on (m = 2), no standby. kill -9 of a whole
node at step 20: the two survivors reshard the committed step from the snapshots in their own
and their peer's RAM and go on at world 2; the node's daemon starts again, the job grows back to
3 and reshards once more.

The check that matters: right after each restore, every rank's model and optimizer state (its
local shards as ``get_state_dict`` gives them, Adam's step and moments included) equals, bit for
bit, what ``dcp.load`` gives at the new world size from the DCP checkpoint of the same step that
the training script itself wrote with ``dcp.save(get_state_dict(model, optim))`` — a separate
job of 2 (then 3) gloo ranks started here loads it. elasticd's own bytes never enter the
reference. Layer widths are not divisible by 2 or 3 (uneven FSDP2 shards, ranks holding no row
of the last layer). The worker is tests/integration/workers/fsdp_trainer.py.
"""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys

import pytest

from elasticd.launcher import job_writable
from tests.chaos.faults import FaultPlan
from tests.chaos.harness import REPO, Attempt, ChaosCluster, Outcome, Recovery, Shape

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(300)]

WORKERS = os.path.join(REPO, "tests", "integration", "workers")
TRAINER = os.path.join(WORKERS, "fsdp_trainer.py")
REFERENCE = os.path.join(WORKERS, "fsdp_dcp_reference.py")
DCP_FROM = 8  # the trainer dcp.saves every step from this one on (the kill is at step 20)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dcp_reference(checkpoint: str, world: int, out: str, timeout: float = 90.0) -> list[dict]:
    """Every rank's local state after ``dcp.load`` of ``checkpoint`` at ``world`` ranks (a
    job of ``world`` gloo processes on 127.0.0.1, all stopped before this returns)."""
    import torch

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, REFERENCE, checkpoint, out],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(r, p.returncode, o[-2000:]) for r, (p, o) in enumerate(zip(procs, outputs))
           if p.returncode != 0]
    assert not bad, f"dcp.load of {checkpoint} at world {world} failed: {bad}"
    return [torch.load(f"{out}-rank{r}.pt", weights_only=True) for r in range(world)]


def restored_dumps(dcp_dir: str, attempt: Attempt) -> list[dict]:
    """What each rank of ``attempt`` dumped right after its restore, by rank."""
    import torch

    paths = sorted(glob.glob(os.path.join(dcp_dir, "restored", f"{attempt.id}-rank*.pt")))
    dumps = {d["rank"]: d for d in (torch.load(p, weights_only=True) for p in paths)}
    assert sorted(dumps) == list(range(attempt.world)), (
        f"attempt {attempt.id} (world {attempt.world}): restored-state dumps of ranks "
        f"{sorted(dumps)}")
    return [dumps[r] for r in range(attempt.world)]


def assert_restore_equals_dcp_load(out: Outcome, rec: Recovery, dcp_dir: str,
                                   workdir: str) -> None:
    """``rec``'s restored state, on every rank, is bitwise what ``dcp.load`` gives at its
    world size from the trainer's own DCP save of the restored step (written by the newest
    earlier attempt that ran that step)."""
    import torch

    i = out.attempts.index(rec.attempt)
    writer = [a for a in out.attempts[:i] if any(rec.step in s for s in a.steps.values())][-1]
    checkpoint = os.path.join(dcp_dir, str(writer.id), str(rec.step))
    assert os.path.exists(os.path.join(checkpoint, ".metadata")), (
        f"no DCP save of step {rec.step} by attempt {writer.id} (the trainer saves from step "
        f"{DCP_FROM}): {out.summary()}")
    world = rec.attempt.world
    got = restored_dumps(dcp_dir, rec.attempt)
    want = dcp_reference(checkpoint, world,
                         os.path.join(workdir, f"reference-{rec.attempt.id}"))
    what = f"world {writer.world} -> {world}, step {rec.step}"
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g["step"] == rec.step and g["world"] == world, (rank, g["step"], g["world"])
        assert g["saved_world"] == writer.world, (
            f"{what}: rank {rank} restored a snapshot of world {g['saved_world']}")
        assert g["groups"] == w["groups"], f"{what}: rank {rank}'s param groups differ"
        assert g["tensors"].keys() == w["tensors"].keys(), (
            f"{what}: rank {rank} restored {sorted(g['tensors'])}, dcp.load gives "
            f"{sorted(w['tensors'])}")
        differ = []
        for name, t in w["tensors"].items():
            mine = g["tensors"][name]
            if mine.dtype != t.dtype or mine.shape != t.shape:
                differ.append(f"{name}: {mine.dtype}{tuple(mine.shape)} against "
                              f"{t.dtype}{tuple(t.shape)}")
            elif not torch.equal(mine.reshape(-1).view(torch.uint8),
                                 t.reshape(-1).view(torch.uint8)):
                diff = (mine.double() - t.double()).abs().max().item() if t.numel() else 0
                differ.append(f"{name}: max abs diff {diff}")
        assert not differ, (f"{what}: rank {rank}'s restored state is not bitwise what "
                            f"dcp.load gives: {differ}\n{out.summary()}")
    # The shards are really uneven and really a part each: at world 3 the last layer's one
    # row sits on rank 0 alone.
    rows = [g["tensors"]["model/14.weight"].shape[0] for g in got]
    assert rows == [1] + [0] * (world - 1), rows


def test_fsdp2_kill9_node_reshards_from_peer_ram_bitwise_like_dcp_load(tmp_path):
    dcp_dir = job_writable(os.path.join(str(tmp_path), "dcp"))
    shape = Shape(standby=(), nnodes="2:3", zero=False, steps=60, step_time=0.1,
                  etcd_members=1)
    plan = FaultPlan().kill_node("n2", at_step=20).restart_node("n2", at_step=26)
    cc = ChaosCluster(tmp_path, shape, train=TRAINER,
                      train_args=("--dcp-dir", dcp_dir, "--dcp-from", str(DCP_FROM)))
    out = cc.run(plan, timeout=150)

    out.assert_finished()
    out.assert_nothing_left()
    assert [a.world for a in out.attempts] == [3, 2, 3], out.summary()
    shrink, grow = out.recoveries
    # The survivors took the step the daemons committed, with the dead node's shard from a
    # peer's RAM: steps lost are the sync lag, nothing older, no disk (there is none).
    assert "peer" in shrink.sources.values(), out.summary()
    assert shrink.step == shrink.committed and shrink.step >= DCP_FROM, out.summary()
    out.assert_sources({"local", "peer"}, {"local", "peer"})
    out.assert_steps_lost()
    out.assert_samples_exactly_once()
    assert grow.step > shrink.step, out.summary()

    assert_restore_equals_dcp_load(out, shrink, dcp_dir, str(tmp_path))
    assert_restore_equals_dcp_load(out, grow, dcp_dir, str(tmp_path))
