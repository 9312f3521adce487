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
import sys

import pytest

from elasticd.launcher import job_writable
from tests.chaos.faults import FaultPlan
from tests.chaos.harness import (REPO, Attempt, ChaosCluster, Outcome, Recovery, Shape,
                                  gloo_job)

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(300)]

WORKERS = os.path.join(REPO, "tests", "integration", "workers")
TRAINER = os.path.join(WORKERS, "fsdp_trainer.py")
REFERENCE = os.path.join(WORKERS, "fsdp_dcp_reference.py")
ZERO_TRAINER = os.path.join(WORKERS, "zero_trainer.py")
ZERO_REFERENCE = os.path.join(WORKERS, "zero_reference.py")
DCP_FROM = 8  # the trainer dcp.saves every step from this one on (the kill is at step 20)


def reference_job(script: str, checkpoint: str, world: int, out: str,
                  timeout: float = 90.0) -> list[dict]:
    """Every rank's local state after ``script`` (fsdp_dcp_reference.py: ``dcp.load``) loaded
    ``checkpoint`` at ``world`` ranks (a job of ``world`` gloo processes on 127.0.0.1, all
    stopped before this returns)."""
    import torch

    gloo_job([sys.executable, script, checkpoint, out], world, timeout)
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


def writer_of(out: Outcome, rec: Recovery) -> Attempt:
    """The newest attempt before ``rec`` that ran the step it restored."""
    i = out.attempts.index(rec.attempt)
    return [a for a in out.attempts[:i] if any(rec.step in s for s in a.steps.values())][-1]


def assert_bitwise_like(out: Outcome, rec: Recovery, writer: Attempt, got: list[dict],
                        want: list[dict], how: str) -> None:
    """Every rank's restored dump (``got``) equals the reference's (``want``) bit for bit."""
    import torch

    world = rec.attempt.world
    what = f"world {writer.world} -> {world}, step {rec.step}"
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g["step"] == rec.step and g["world"] == world, (rank, g["step"], g["world"])
        assert g["saved_world"] == writer.world, (
            f"{what}: rank {rank} restored a snapshot of world {g['saved_world']}")
        assert g["groups"] == w["groups"], f"{what}: rank {rank}'s param groups differ"
        assert g["tensors"].keys() == w["tensors"].keys(), (
            f"{what}: rank {rank} restored {sorted(g['tensors'])}, {how} gives "
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
                            f"{how} gives: {differ}\n{out.summary()}")


def assert_restore_equals_dcp_load(out: Outcome, rec: Recovery, dcp_dir: str,
                                   workdir: str) -> None:
    """``rec``'s restored state, on every rank, is bitwise what ``dcp.load`` gives at its
    world size from the trainer's own DCP save of the restored step (written by the newest
    earlier attempt that ran that step)."""
    writer = writer_of(out, rec)
    checkpoint = os.path.join(dcp_dir, str(writer.id), str(rec.step))
    assert os.path.exists(os.path.join(checkpoint, ".metadata")), (
        f"no DCP save of step {rec.step} by attempt {writer.id} (the trainer saves from step "
        f"{DCP_FROM}): {out.summary()}")
    world = rec.attempt.world
    got = restored_dumps(dcp_dir, rec.attempt)
    want = reference_job(REFERENCE, checkpoint, world,
                         os.path.join(workdir, f"reference-{rec.attempt.id}"))
    assert_bitwise_like(out, rec, writer, got, want, "dcp.load")
    # The shards are really uneven and really a part each: the last layer's one row sits on
    # rank 0 alone.
    rows = [g["tensors"]["model/14.weight"].shape[0] for g in got]
    assert rows == [1] + [0] * (world - 1), rows


def test_fsdp2_kill9_node_reshards_from_peer_ram_bitwise_like_dcp_load(tmp_path):
    dcp_dir = job_writable(os.path.join(str(tmp_path), "dcp"))
    # 90 steps: the restarted node joins once its zygote has imported torch; at 60 it grew
    # back at step 48 in CI and at 59 in a bench run, close to a job already finished.
    shape = Shape(standby=(), nnodes="2:3", zero=False, steps=90, step_time=0.1,
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
    # Both reshards took the worker's own fetch (worker/direct.py), which the daemons
    # counted from the reports; none fell back to the daemon's path.
    direct = [line for log in glob.glob(os.path.join(str(tmp_path), "n*.log"))
              for line in open(log) if "fetched its rows itself" in line]
    assert len(direct) >= 2 and all(" 0 straight into" not in d for d in direct), direct
    workers = [line for log in glob.glob(os.path.join(str(tmp_path), "n*", "jobs", "*",
                                                      "agent.log"))
               for line in open(log) if "through its daemon instead" in line]
    assert not workers, workers


def test_zero_kill9_node_reshards_from_peer_ram_bitwise_like_consolidated(tmp_path):
    # The same pair for ZeroRedundancyOptimizer (Adam state partitioned by whole parameters,
    # differently at world 2 and 3), against the state the trainer consolidated
    # (consolidate_state_dict) at the restored step, loaded at the new world size.
    ref_dir = job_writable(os.path.join(str(tmp_path), "consolidated"))
    # DDP steps are quicker than FSDP2's: slower ones leave the restarted node time to join.
    shape = Shape(standby=(), nnodes="2:3", zero=False, steps=90, step_time=0.25,
                  etcd_members=1)
    plan = FaultPlan().kill_node("n2", at_step=20).restart_node("n2", at_step=26)
    cc = ChaosCluster(tmp_path, shape, train=ZERO_TRAINER,
                      train_args=("--ref-dir", ref_dir, "--ref-from", str(DCP_FROM)))
    out = cc.run(plan, timeout=150)

    out.assert_finished()
    out.assert_nothing_left()
    assert [a.world for a in out.attempts] == [3, 2, 3], out.summary()
    shrink, grow = out.recoveries
    assert "peer" in shrink.sources.values(), out.summary()
    assert shrink.step == shrink.committed and shrink.step >= DCP_FROM, out.summary()
    out.assert_sources({"local", "peer"}, {"local", "peer"})
    out.assert_steps_lost()
    out.assert_samples_exactly_once()
    assert grow.step > shrink.step, out.summary()

    owned = {}
    for rec in (shrink, grow):
        writer = writer_of(out, rec)
        checkpoint = os.path.join(ref_dir, str(writer.id), f"{rec.step}.pt")
        assert os.path.exists(checkpoint), (
            f"no consolidated state of step {rec.step} by attempt {writer.id}: {out.summary()}")
        got = restored_dumps(ref_dir, rec.attempt)
        want = reference_job(ZERO_REFERENCE, checkpoint, rec.attempt.world,
                             os.path.join(str(tmp_path), f"reference-{rec.attempt.id}"))
        assert_bitwise_like(out, rec, writer, got, want, "ZeroRedundancyOptimizer."
                            "load_state_dict of the consolidated state")
        assert [g["owned"] for g in got] == [w["owned"] for w in want]
        owned[rec.attempt.world] = [g["owned"] for g in got]
    # Really resharded: at world 2 some rank owns parameters that two old ranks owned at 3.
    assert not all(any(set(new) <= set(old) for old in owned[3]) for new in owned[2]), owned
