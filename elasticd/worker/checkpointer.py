"""The training script's API: ``Checkpointer`` snapshots the whole training state every step
into RAM owned by the node's daemon, and restores it after a restart.

::

    ckpt = elasticd.Checkpointer(every=1)
    state = {"model": model, "optim": opt, "sampler": sampler, "rng": RNGState()}
    step = ckpt.restore(state)          # after init_process_group; 0 on a fresh start
    while step < total:
        train_one_step()
        step += 1
        ckpt.save(step, state)

``save`` does on the training thread only what cannot wait: it waits for the previous snapshot,
flattens the state (no copy), asks the daemon for a slot and copies the tensors that the next
forward pass could change (module buffers such as BatchNorm statistics, loose tensors). The rest
— parameters and optimizer state, which only ``optimizer.step`` changes — is copied by a
background thread while the next forward and backward run; a step pre-hook on every optimizer
in the state waits for that copy before the optimizer mutates anything. The same thread then
writes the header and asks the daemon to seal the snapshot (checksums are computed there).

The Checkpointer makes the job protected by itself (docs/worker-api.md, "The Checkpointer"):
``register`` when it starts and after every restore, and each ``save``'s slot request counts
as a progress report; while the daemon's replies say the job is unprotected, a warning is logged
at most once a minute.

Nothing here ever raises into the training loop because of the daemon: a refused, skipped or
failed snapshot is logged (once per kind) and counted. A state that cannot be snapshotted at all
(a value with no exact form, a tensor subclass, a DTensor placement elasticd does not store) is
different: the first ``save`` raises ``UnsupportedValue`` with the reason (even when that step is
not one to snapshot), and the daemon is told, so the job shows as unprotected everywhere
(``/status``, ``elasticctl``, ``elasticd_jobs_unprotected{reason="snapshots_failing"}``).
Sharded state (FSDP2's DTensors) is snapshotted without gathering: each rank stores its local
shards with their global layout (:mod:`elasticd.worker.shards`). Without a daemon (``ELASTICD_SOCKET``
unset) ``save`` does nothing and ``restore`` returns 0, after one warning — unless
``persist_dir`` is given: then restore reads that persistent tier directly. Worker side.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Any, Callable, Mapping, MutableMapping

import torch

import elasticd.worker
from elasticd.worker import held_state, in_process
from elasticd.worker import restore as _restore
from elasticd.worker.sources import Sources, close_fds
from elasticd.worker.copier import Copier, CpuCopier, copy_into
from elasticd.snapshot.format import PREAMBLE_SIZE
from elasticd.worker.optimizer_fence import OptimizerFence
from elasticd.worker.slot_maps import SlotMaps
from elasticd.worker.snapshot_plan import Plan, Planner, compact_json, meta_json, sync_mask
from elasticd.worker.state import FlatState, UnsupportedValue
from elasticd.clock import SYSTEM_CLOCK

log = logging.getLogger("elasticd.checkpoint")

__all__ = ["Checkpointer", "RestoreResult"]
RestoreResult = _restore.RestoreResult
UNPROTECTED_EVERY = 60.0  # seconds between two warnings that the job is still unprotected


class Notices:
    """What a worker's Checkpointer tells the training script's log about elasticd: each kind of
    failure once (then counted), and the daemon's word that the job is unprotected at most once
    a minute, and once more when it is protected again."""

    def __init__(self, who: str) -> None:
        #: Names the worker in the warnings (``job j rank 0``; its rank may change in
        #: in-process mode).
        self.who = who
        self._warned: set[str] = set()
        self._said = ""  # what the daemon last said, "" while protected
        #: When the unprotected warning was last logged (monotonic), None while protected.
        self.warned_at: float | None = None

    def once(self, key: str, message: str) -> None:
        """Logs ``message`` the first time ``key`` comes."""
        if key not in self._warned:
            self._warned.add(key)
            log.warning("elasticd: %s", message)

    def heard(self, reply: dict[str, Any] | None, now: float) -> None:
        """Warns (at most once a minute) while the daemon says the job is unprotected."""
        if reply is None:
            return
        said = reply.get("unprotected") or ""
        if said and (said != self._said or self.warned_at is None
                     or now - self.warned_at >= UNPROTECTED_EVERY):
            log.warning("elasticd: %s: %s", self.who, said)
            self.warned_at = now
        elif not said and self._said:
            log.warning("elasticd: %s is protected again", self.who)
            self.warned_at = None
        self._said = said


class Checkpointer:
    """Snapshots and restores a training state through the node's elasticd.

    Args:
        every: snapshot every this many steps (``save`` is a no-op on the others).
        transport: how to reach the daemon, a :class:`~elasticd.worker.transport.Transport`
            (default: ``elasticd.worker``'s client from the environment; None when
            ``ELASTICD_SOCKET`` is unset).
        job, rank, world_size, local_world_size: default from the environment torchrun and
            elasticd set (``ELASTICD_JOB``, ``RANK``, ...) or the initialised process group;
            rank and sizes not given are read again at each :meth:`restore` (under
            ``@elasticd.in_process`` a re-formed round may give the process another rank).
        copier: moves tensors into the slot (default: a background-thread CPU copier; pass
            :class:`~elasticd.worker.cuda_copier.CudaCopier` for a model on the GPU).
        persist_dir: the persistent tier to restore from when there is no daemon.
        collective: how ranks agree at restore (default: the initialised process group).
        timeout: seconds to wait for a copy before giving up on it.
        replicated: more state entries that must be identical on every rank after a restore
            (DDP-wrapped modules are checked always); a mismatch raises ``ReplicaMismatch``.
    """

    def __init__(self, every: int = 1, *, transport: Any = ..., job: str | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 local_world_size: int | None = None, copier: Copier | None = None,
                 persist_dir: str | None = None, collective: Any = None,
                 timeout: float = 300.0, replicated: tuple[str, ...] = ()) -> None:
        if type(every) is not int or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        self.every, self.persist_dir, self.timeout = every, persist_dir, timeout
        self.replicated = tuple(replicated)
        env = os.environ
        if transport is ...:  # the package's client (and not its warning) under a daemon only
            transport = elasticd.worker.default_client() if env.get("ELASTICD_SOCKET") else None
        self.transport = transport
        self.job = job or env.get("ELASTICD_JOB") or env.get("TORCHELASTIC_RUN_ID") or "default"
        # What was given of the worker's place in the group (None: read at each restore),
        # and how its ranks agree at restore (None: the initialised process group).
        self._given = (rank, world_size, local_world_size, collective)
        self.rank, self.world_size, self.local_world_size = self._identity()
        self.copier = copier or CpuCopier(background=True)
        self.last_restore: RestoreResult | None = None
        #: The snapshot the live state still is while nothing changes it (held_state).
        self._held: held_state.Held | None = None
        #: Totals: ``stall_seconds`` (in save), ``hook_wait_seconds`` (optimizer pre-hooks),
        #: ``copy_seconds`` (background copy after save returned), ``seal_seconds`` (header
        #: and the daemon's checksums, on the background thread).
        self.stats = {"saves": 0, "skipped": 0, "failed": 0, "stall_seconds": 0.0,
                      "hook_wait_seconds": 0.0, "copy_seconds": 0.0, "seal_seconds": 0.0}
        self._planner = Planner(self.job)  # the state flattened, its layout cached
        self._slots = SlotMaps(self.copier)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="elasticd-seal")
        self._fence = OptimizerFence(timeout, self._waited)  # holds optimizers for the copy
        self._done: concurrent.futures.Future | None = None  # the copy in flight + its seal
        self._notices = Notices(f"job {self.job} rank {self.rank}")
        if not in_process.staged():  # no rank yet (torch's placeholder): its restore registers
            self._register()

    # -- restore --------------------------------------------------------------------------

    def restore(self, state: MutableMapping[str, Any]) -> int:
        """Loads the newest step every rank can load into ``state``; returns that step.

        Call it on every rank, after ``init_process_group`` and after building every object
        in ``state``. Returns 0 when there is nothing to restore. Under
        ``@elasticd.in_process``, call it at the top of the decorated function: every round
        (a survivor's as a fresh worker's) then starts from the same agreed step, this
        worker's new rank's shard, and new snapshots carry a new generation.

        Raises:
            RestoreError: the agreed snapshot does not fit the state (on every rank).
        """
        _drop_grads(state)
        if self.transport is None and not self.persist_dir:
            self._notices.once("nodaemon", "ELASTICD_SOCKET is not set: not running under elasticd, "
                            "so nothing is restored and snapshots are off")
            self.last_restore = RestoreResult()
            return 0
        self.wait()
        # The place this process restored or snapshotted in last (a survivor of a re-formed
        # round): its rank's slots hold what this process wrote, offered to the agreement.
        # A fresh process its agent restarted on the same node (a fallback) offers the slots
        # of the rank its worker was, as its agent says: its node's RAM still holds them.
        was = (self.rank, self.world_size, self.local_world_size)
        active = self.last_restore is not None or self._planner.current is not None
        previous = was[:2] if active else in_process.restarted_from()
        self._follow()
        collective = self._given[3] or (
            _restore.TorchCollective() if torch.distributed.is_available()
            and torch.distributed.is_initialized() else _restore.Solo())
        sources = Sources(self.transport, self.job, self.rank, self.world_size, self.persist_dir,
                          previous=previous)
        sources.held = self._still_held(state)
        try:
            result = _restore.restore(state, sources, collective, SYSTEM_CLOCK.perf_counter,
                                      _restore.replicated_keys(state, self.replicated),
                                      wall=SYSTEM_CLOCK.wall)
        except BaseException:
            # Nothing restored in the new place: the next restore still offers the old one's.
            self.rank, self.world_size, self.local_world_size = was
            raise
        self.last_restore = result
        if not result.in_memory:
            self._held = None  # loaded (or nothing was): not the snapshot it was
        self._tell("ckpt_report", job=self.job, rank=self.rank, source=result.source,
                   seconds=result.seconds, steps_lost=result.steps_lost, bytes=result.nbytes,
                   generation=result.generation, step=result.step, refused=result.refused,
                   next_generation=result.next_generation,
                   path="in_process" if in_process.kept() else "restart",
                   **({"direct": result.direct} if result.direct else {}))
        self._register(result.step, one_way=True)
        return result.step

    @property
    def generation(self) -> int:
        """The generation new snapshots carry: the last restore's ``next_generation`` (0
        before one)."""
        return self.last_restore.next_generation if self.last_restore is not None else 0

    def _still_held(self, state: Mapping[str, Any]) -> Any:
        """The version of the last snapshot ``state`` was saved as, when nothing has changed
        it since (:mod:`.held_state`), else None."""
        if self._held is None:
            return None
        try:
            flat = self._planner.flatten(state)
        except Exception:  # noqa: BLE001 — the restore says what is wrong with the state
            return None
        return held_state.still(self._held, held_state.mark(
            flat, self._fence.steps, sync_mask(state, flat.names)))

    def _identity(self) -> tuple[int, int, int]:
        """Rank, world size and local world size: as given, else from the initialised
        process group (or torchrun's environment without one)."""
        rank, world, local, _ = self._given
        env, dist = os.environ, torch.distributed
        grouped = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if grouped else int(env.get("RANK", 0))
        if world is None:
            world = dist.get_world_size() if grouped else int(env.get("WORLD_SIZE", 1))
        if local is None:
            local = int(env.get("LOCAL_WORLD_SIZE", world))
        return rank, world, local

    def _follow(self) -> None:
        """Takes this worker's place in the current group before a restore. Under
        ``@elasticd.in_process`` one Checkpointer lives through every round of its process,
        and a re-formed round may give it another rank and world size: the restore must
        fetch the new rank's shard and the snapshots after it must be that rank's."""
        place = self._identity()
        if place == (self.rank, self.world_size, self.local_world_size):
            return
        log.info("elasticd: job %s: this worker is now rank %d of %d (was %d of %d)",
                 self.job, place[0], place[1], self.rank, self.world_size)
        moved = place[0] != self.rank
        self.rank, self.world_size, self.local_world_size = place
        self._notices.who = f"job {self.job} rank {self.rank}"
        if moved and self.transport is not None:
            # The daemon binds a process's writes to the rank its open connections first
            # wrote for (daemon/local_binding.py): a new rank needs a new connection, the old
            # one closed. The restore's reads and collectives come before its first write.
            self.transport.close()

    def _register(self, step: int | None = None, unsnapshottable: str = "",
                  one_way: bool = False) -> None:
        """Tells the daemon who this worker is (it places replicas by the group's ranks).
        ``one_way`` after a restore: the last thing before training again, and a call waited
        for a daemon busy with the recovery; its reply (whether the job is protected) comes
        with the next slot request's too."""
        if self.transport is None:
            return
        fields: dict[str, Any] = {"job": self.job, "rank": self.rank,
                                  "world_size": self.world_size}
        for field, var in (("restart", "TORCHELASTIC_RESTART_COUNT"),
                           ("local_rank", "LOCAL_RANK")):
            if os.environ.get(var, "").isdigit():
                fields[field] = int(os.environ[var])
        if step is not None:
            fields["step"] = step
        if unsnapshottable:
            fields["unsnapshottable"] = unsnapshottable[:1000]
        if one_way:
            self._tell("register", **fields)
        else:
            self._heard(self._call("register", **fields))

    def _flatten(self, state: Mapping[str, Any], pending: "_Reservation | None" = None
                 ) -> FlatState:
        """Flattens ``state``; a state that cannot be snapshotted is reported to the daemon
        (the job is unprotected) and raised. ``pending``: a slot request in flight, given up
        first (its reply holds the connection the report needs)."""
        try:
            return self._planner.flatten(state)
        except UnsupportedValue as exc:
            if pending is not None:
                pending.drop()
            log.error("elasticd: job %s rank %d: the training state cannot be snapshotted, so "
                      "the job is NOT protected: %s", self.job, self.rank, exc)
            self._register(unsnapshottable=str(exc))
            raise

    def _heard(self, reply: dict[str, Any] | None) -> None:
        self._notices.heard(reply, SYSTEM_CLOCK.monotonic())

    # -- save -----------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> bool:
        """Starts a snapshot of ``state`` as ``step`` (returns at once; see the module doc).

        Returns:
            True if a snapshot was started; False when skipped (not every K steps, no daemon,
            over the daemon's memory cap, or any failure, which is logged).

        Raises:
            UnsupportedValue: ``state`` holds something that cannot be snapshotted (a bug in
                the script, not a runtime failure); checked at the first call whatever the
                step, and the daemon told (the job shows as unprotected).
        """
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if self.transport is None:
            self._notices.once("nodaemon", "ELASTICD_SOCKET is not set: not running under "
                            "elasticd, so snapshots are off")
            return False
        if step % self.every:
            if not self._planner.checked:
                self._flatten(state)
            return False
        start = SYSTEM_CLOCK.perf_counter()
        self.wait()
        # The slot request travels while the state is flattened: the same size as last time,
        # unless flattening finds the state grew (then it is asked for again). Sent from this
        # thread and its reply read after the flatten: sent from the pool instead, it waited
        # for the GIL the flatten holds (2.3 ms, where the round trip alone takes 1; FSDP2,
        # 48 layers).
        known = self._planner.current
        mapped = self._slots.mapped()  # the daemon sends no descriptor for these
        early = known is not None and not known.stale
        pending = self._start_reserve(known.layout.total_size, step, mapped) if early else None
        try:
            flat = self._flatten(state, pending)
            self._fence.watch(state)
            plan = self._planner.plan_for(flat, state)
        except BaseException:
            if pending is not None:
                pending.drop()
            raise
        reply = pending.result() if pending is not None else None
        if not early or (reply is not None and not reply.get("skip")
                         and int(reply["capacity"]) < plan.layout.total_size):
            if reply is not None:
                close_fds(reply)  # too small: given up for a bigger slot
            reply = self._start_reserve(plan.layout.total_size, step, mapped).result()
        if reply is None or reply.get("skip"):
            self.stats["skipped"] += 1
            if reply is not None and not reply.get("grid"):  # a grid skip is routine
                self._notices.once("skip", f"snapshot skipped by elasticd: {reply.get('reason')} "
                                "(further skips are counted, not logged)")
            return False
        try:
            buf = self._slots.map(reply)
            sync = [t for t, m in zip(flat.tensors, plan.sync_mask) if m]
            rest = [t for t, m in zip(flat.tensors, plan.sync_mask) if not m]
            copy_into(sync, buf, plan.sync)
            self._fence.copy = self.copier.start(rest, buf, plan.rest)
        except Exception as exc:  # noqa: BLE001 — a slot we cannot use is a skipped snapshot
            self._failed("copy", exc)
            return False
        copied_from = SYSTEM_CLOCK.perf_counter()
        stall = copied_from - start
        self.stats["stall_seconds"] += stall
        self._done = self._pool.submit(self._seal, self._fence.copy, buf, plan, step, flat.meta,
                                       reply["ticket"], stall, copied_from)
        # Marked only where a later restore can find the state kept (an in-process worker):
        # elsewhere the mark would cost the training thread a pass over the tensors and the
        # meta's encoding at every save for nothing.
        now = (held_state.mark(flat, self._fence.steps, plan.sync_mask)
               if in_process.linked() else None)
        self._held = None if now is None else held_state.Held((self.generation, step), now)
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Waits until the snapshot in flight is copied and sealed (errors are logged)."""
        done, self._done = self._done, None
        if done is not None:
            try:
                done.result(self.timeout if timeout is None else timeout)
            except Exception as exc:  # noqa: BLE001
                self._failed("seal", exc)

    def close(self) -> None:
        """Waits for the last snapshot, removes the optimizer hooks, unmaps the slots."""
        self.wait()
        self._fence.close()
        self._planner.close()
        self._pool.shutdown(wait=True)
        self.copier.close()
        self._slots.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------

    def _start_reserve(self, nbytes: int, step: int, mapped: list[list[int]]
                       ) -> "_Reservation":
        """``ckpt_reserve`` sent, its reply read later (:class:`_Reservation`); at once with a
        transport that cannot split a call."""
        fields = {"job": self.job, "rank": self.rank, "world_size": self.world_size,
                  "nbytes": nbytes, "local_world_size": self.local_world_size, "step": step,
                  "generation": self.generation, "mapped": mapped}
        try:
            return _Reservation(self._failed, self._heard,
                                call=self.transport.start("ckpt_reserve", **fields))
        except Exception as exc:  # noqa: BLE001 — never an error in the training loop
            self._failed("ckpt_reserve", exc)
            return _Reservation(self._failed, self._heard)

    def _seal(self, copy: Any, buf: Any, plan: Plan, step: int, meta: dict, ticket: int,
              stall: float, copied_from: float) -> None:
        """On the background thread: waits for the copy, writes the header JSON, completes."""
        copy.wait(self.timeout)
        sealing = SYSTEM_CLOCK.perf_counter()
        self.stats["copy_seconds"] += sealing - copied_from
        body = (plan.prefix + f',"job":{compact_json(self.job)},"step":{step},"generation":'
                f'{self.generation},"rank":{self.rank},"world_size":{self.world_size},'
                '"meta":').encode() + meta_json(meta) + b"}"
        if PREAMBLE_SIZE + len(body) > plan.layout.data_offset:
            plan.stale = True  # the meta outgrew the header reserve: re-plan next time
            raise RuntimeError(f"header of {len(body)} bytes outgrew its reserve; snapshot of "
                               f"step {step} dropped")
        with memoryview(buf) as view:
            view[PREAMBLE_SIZE : PREAMBLE_SIZE + len(body)] = body
        hook_stall = self._fence.take_stall()
        if self._call("ckpt_complete", job=self.job, rank=self.rank, ticket=ticket,
                      header_size=len(body), stall_seconds=stall + hook_stall) is not None:
            self.stats["saves"] += 1
        self.stats["seal_seconds"] += SYSTEM_CLOCK.perf_counter() - sealing

    def _waited(self, seconds: float) -> None:
        self.stats["hook_wait_seconds"] += seconds

    def _tell(self, op: str, **fields: Any) -> None:
        """``op`` one-way (:meth:`Transport.send`; a transport that cannot send one-way calls).
        For a report whose reply nothing reads: a call waited for the daemon, busy with the
        recovery at that moment (10-40 ms of a restore seen in the in-process benchmark).
        The daemon reads one connection's requests in order, so the call that follows on it
        (``register``) is answered after the report was handled."""
        if self.transport is None:
            return
        try:
            if self.transport.send(op, **fields):
                return
        except Exception as exc:  # noqa: BLE001 — never an error in the training loop
            self._failed(op, exc)
            return
        # Dropped (nothing of it reached the daemon): as a call.
        self._call(op, **fields)

    def _call(self, op: str, **fields: Any) -> dict[str, Any] | None:
        if self.transport is None:
            return None
        try:
            return self.transport.call(op, **fields)
        except Exception as exc:  # noqa: BLE001 — never an error in the training loop
            self._failed(op, exc)
            return None

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats["failed"] += 1
        self._notices.once(f"fail-{what}", f"elasticd {what} failed: {exc} (training goes on; "
                        "further failures of this kind are counted, not logged)")


def _drop_grads(state: Mapping[str, Any]) -> None:
    """Drops the gradients of every parameter of ``state``'s modules and optimizers: a restore
    puts the state at a step boundary, as a restarted worker's fresh process has it. A survivor
    re-entering its function (``@elasticd.in_process``) may hold the gradients of the step its
    group broke in, which backward would add the next step's to (DDP then averaged both)."""
    for value in state.values():
        if isinstance(value, torch.nn.Module):
            params: Any = value.parameters()
        elif isinstance(value, torch.optim.Optimizer):
            params = (p for g in value.param_groups for p in g["params"])
        else:
            continue
        for p in params:
            p.grad = None


class _Reservation:
    """A slot request in flight: its reply is read once, by :meth:`result` or :meth:`drop`."""

    def __init__(self, failed: Callable[[str, BaseException], None],
                 heard: Callable[[dict[str, Any] | None], None], call: Any = None) -> None:
        self._failed, self._heard, self._call = failed, heard, call

    def result(self) -> dict[str, Any] | None:
        """The reply (None on a failure, counted and logged)."""
        call, self._call, reply = self._call, None, None
        if call is not None:
            try:
                reply = call.result()
            except Exception as exc:  # noqa: BLE001 — never an error in the training loop
                self._failed("ckpt_reserve", exc)
        self._heard(reply)
        return reply

    def drop(self) -> None:
        """The slot is not wanted after all: the reply is read, its descriptors closed."""
        call, self._call = self._call, None
        if call is not None:
            call.close()
