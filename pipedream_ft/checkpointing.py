"""Consistent pipeline checkpoints without a global barrier, and exact resume.

**The cut.** A checkpoint is taken at a *cut* ``c``: a minibatch number that is a multiple of every stage's
replica count (and of ``flush_every`` in flushing mode). Every rank saves right after its update for the last
minibatch before ``c`` — so every stage's part holds exactly the updates of minibatches ``0 .. c-1`` — and the
data position ``c``. Stage 0 decides (its policy, or a preemption notice) while it runs the forward of
minibatch ``c - 1`` and marks that minibatch's activation header; the mark reaches every later stage before
that stage's own update for ``c - 1``, so nobody stops to agree. Replicas of a stage that did not see the
marked minibatch learn of it in the same round's gradient all-reduce.

**What is in flight.** At the cut, stage ``s`` has already run forwards of a few minibatches ``>= c`` whose
backwards are still to come. Its part also keeps the weight versions those forwards used (the stash). On
resume the schedule restarts at ``c``; its warm-up forwards recompute exactly those minibatches with the
stashed versions and the same per-minibatch RNG seeds, so everything after the cut is bitwise what the
uninterrupted run computed.

**Commit.** Each rank's part is persisted in the background (:class:`~pipedream_ft.checkpoint.CheckpointWriter`);
rank 0 writes the commit record once every part is durable. On start, the ranks agree on the newest
committed checkpoint whose every part verifies, and all load that one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from datetime import timedelta
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .checkpoint import (CheckpointError, CheckpointWriter, CorruptCheckpointError, Storage, list_committed,
                         load_part, read_commit)
from .elastic import store_profile
from .checkpoint.format import part_data_path
from .errors import PipelineError
from .faults import FaultInjector
from .policies import CheckpointPolicy, EveryNSteps, PreemptionHandler

if TYPE_CHECKING:
    from .runtime import PipelineTrainer

__all__ = ["CheckpointConfig", "Checkpointer", "Preempted", "plan_hash"]

log = logging.getLogger(__name__)


class Preempted(PipelineError):
    """A preemption notice (SIGTERM) arrived; the emergency checkpoint is committed and the rank stops."""


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Where and when to checkpoint."""

    url: str
    """Any fsspec URL: a local directory, ``s3://bucket/prefix``, ``memory://...``."""
    storage_options: dict[str, Any] | None = None
    """fsspec options, e.g. ``{"client_kwargs": {"endpoint_url": ...}}`` for S3-compatible servers."""
    policy: CheckpointPolicy = field(default_factory=lambda: EveryNSteps(100))
    """When to save; evaluated by stage 0 at every possible cut (steps count minibatches)."""
    keep: int = 3
    """Committed checkpoints kept."""
    resume: bool = True
    """Start from the newest committed checkpoint if there is one."""
    emergency_save: bool = True
    """On SIGTERM, commit a checkpoint at the next cut before exiting, if it fits in ``grace_s``."""
    grace_s: float = 30.0
    """Time a preemption notice leaves before the machine goes away."""
    commit_timeout_s: float = 120.0
    """A checkpoint whose parts are not all durable this long after it was taken is given up."""

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("checkpoint url must not be empty")
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")
        if self.grace_s <= 0 or self.commit_timeout_s <= 0:
            raise ValueError(f"grace_s and commit_timeout_s must be > 0, got {self.grace_s}, {self.commit_timeout_s}")


def plan_hash(trainer: PipelineTrainer) -> str:
    """Identifies the plan and training semantics a checkpoint was written under."""
    body = {
        "profile_hash": trainer.plan.profile_hash,
        "stages": [[list(s.layers), s.replicas] for s in trainer.plan.stages],
        "mode": trainer.config.mode,
        "flush_every": trainer.config.flush_every if trainer.config.mode == "flush" else None,
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class Checkpointer:
    """One rank's side of checkpointing: deciding (stage 0), saving, committing (rank 0) and resuming."""

    def __init__(self, trainer: PipelineTrainer, config: CheckpointConfig, faults: FaultInjector) -> None:
        self.t = trainer
        self.config = config
        self.faults = faults
        self.storage = Storage(config.url, config.storage_options)
        self.storage.check_writable()
        if faults:
            self.storage.write_bytes = faults.wrap_part_write(self.storage.write_bytes)  # type: ignore[method-assign]
        plan = trainer.plan
        self.part = f"stage{trainer.stage_index}-replica{trainer.replica}"
        parts = [f"stage{s.index}-replica{i}" for s in plan.stages for i in range(s.replicas)]
        self.plan_hash = plan_hash(trainer)
        self.metadata = {"plan_hash": self.plan_hash, "profile_hash": plan.profile_hash,
                         "world_size": plan.world_size, "num_stages": plan.num_stages,
                         "stages": [[list(s.layers), s.replicas] for s in plan.stages]}
        if trainer.profile is not None and trainer.env.rank == 0:
            store_profile(self.storage, trainer.profile)
        self.writer = CheckpointWriter(self.storage, self.part, expected_parts=parts,
                                       is_committer=trainer.env.rank == 0, keep=config.keep,
                                       commit_timeout_s=config.commit_timeout_s, metadata=self.metadata)
        multiple = math.lcm(*trainer.replicas)
        if trainer.config.mode == "flush":
            multiple = math.lcm(multiple, trainer.config.flush_every)
        self.cut_multiple = multiple
        self.last_cut = -1
        """The newest cut decided (stage 0), saved or resumed from."""
        self.last_saved = -1
        self.preemption = PreemptionHandler(grace_s=config.grace_s) if config.emergency_save else None
        if self.preemption is not None:
            try:
                self.preemption.install()
            except ValueError:  # not the main thread: no signal handlers there
                self.preemption = None
        self._announced = False
        self._last_store_check = 0.0
        self._last_forward = time.monotonic()
        self.last_save_s = 0.0
        self._handles: list[Any] = []
        self._started = time.time()

    # -- resume ---------------------------------------------------------------------------------------------

    def resume(self) -> int | None:
        """Load the newest checkpoint every rank can verify; return its cut, or ``None``. A collective."""
        if not self.config.resume:
            return None
        steps: list[Any] = [list_committed(self.storage) if self.t.env.rank == 0 else None]
        dist.broadcast_object_list(steps, src=0)
        for step in reversed(steps[0]):
            parts: list[dict[str, Any]] = []
            problem = ""
            resharded = False
            try:
                record = read_commit(self.storage, step)
                meta = record.metadata
                if meta.get("plan_hash") == self.plan_hash:
                    parts = [load_part(self.storage, step, self.part, record=record)]
                elif meta.get("profile_hash") == self.t.plan.profile_hash and "stages" in meta:
                    resharded = True  # written under another plan of the same model: gather my layers
                    mine = set(self.t.plan.stages[self.t.stage_index].layers)
                    for index, (layers, _replicas) in enumerate(meta["stages"]):
                        if mine & set(layers) or (index == 0 and self.t.extra_state):
                            parts.append(load_part(self.storage, step, f"stage{index}-replica0", record=record))
                else:
                    raise CheckpointError(
                        f"checkpoint {step} in {self.storage.url} was written for another model (profile hash "
                        f"{str(meta.get('profile_hash'))[:12]}, this model's {self.t.plan.profile_hash[:12]}); "
                        "use another checkpoint directory"
                    )
            except CorruptCheckpointError as exc:
                problem = str(exc)
            flags = [None] * self.t.env.world_size
            dist.all_gather_object(flags, problem)
            bad = [f for f in flags if f]
            if bad:
                log.warning("checkpoint %d is not usable (%s); trying an older one", step, bad[0])
                continue
            if resharded:
                old = [[len(l), r] for l, r in record.metadata["stages"]]
                start = self.t._restore_resharded(parts, step)
                if self.t.env.rank == 0:
                    msg = (f"checkpoint {step} was written by a {len(old)}-stage plan on "
                           f"{record.metadata.get('world_size')} workers; resharded into "
                           f"{self.t.plan.num_stages} stages on {self.t.env.world_size} workers")
                    log.warning(msg)
                    print(f"pipedream-ft: {msg}", flush=True)
            else:
                self.t._restore_state(parts[0])
                start = step
            self.last_cut = start
            self.config.policy.reset(time.monotonic(), start)
            return start
        return None
    # -- deciding (stage 0) ---------------------------------------------------------------------------------

    def flags_for(self, b: int) -> tuple[bool, bool]:
        """At stage 0's forward of minibatch ``b``: (checkpoint at cut ``b + 1``?, stop after it?)."""
        now = time.monotonic()
        self.config.policy.observe(step_time_s=now - self._last_forward)
        self._last_forward = now
        cut = b + 1
        if cut % self.cut_multiple or cut <= self.last_cut:
            return False, False
        if self.preemption_requested(now):
            assert self.preemption is not None
            self.last_cut = cut  # no further decisions: this is the last cut of the attempt
            if self.preemption.fits(self.last_save_s * 2 + 1.0, now=now):
                self.config.policy.record_save(cut, now)
                return True, True
            return False, True
        save = self.config.policy.should_save(cut, now)
        if save:
            self.last_cut = cut
        return save, False

    def preemption_requested(self, now: float | None = None) -> bool:
        """A preemption notice here, or announced by another rank through the store (checked every 50 ms)."""
        if self.preemption is None:
            return False
        if self.preemption.requested:
            return True
        now = time.monotonic() if now is None else now
        store = self._attempt_store()
        if store is not None and now - self._last_store_check > 0.05:
            self._last_store_check = now
            try:
                return store.check(["preempted"])
            except Exception:  # a store problem must not stop training
                return False
        return False

    def announce_preemption(self) -> None:
        """Called on any rank after each action: tell stage 0 (through the store) that SIGTERM arrived."""
        if self.preemption is not None and self.preemption.requested and not self._announced:
            self._announced = True
            log.warning("rank %d: preemption notice received; asking for an emergency checkpoint", self.t.env.rank)
            store = self._attempt_store()
            if store is not None:
                store.set("preempted", str(self.t.env.rank))

    @staticmethod
    def _attempt_store() -> Any:
        """The default group's store: scoped to this attempt, so a notice does not outlive its attempt."""
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # not joined
            return None

    # -- saving ---------------------------------------------------------------------------------------------

    def save(self, cut: int, stop: bool) -> None:
        self._maybe_corrupt(cut)
        t0 = time.perf_counter()
        handle = self.writer.save(cut, self.t._capture_state(cut))
        self.last_save_s = time.perf_counter() - t0
        self.last_cut = max(self.last_cut, cut)
        self.last_saved = cut
        self._handles.append(handle)
        del self._handles[:-4]
        if self.t.recorder is not None:
            end = time.time()
            self.t.recorder.complete("checkpoint", "checkpoint", end - self.last_save_s, end, cut=cut,
                                     snapshot_s=handle.snapshot_s)
        if self.t.is_first:
            self.config.policy.observe(checkpoint_cost_s=handle.snapshot_s)
        log.info("rank %d: checkpoint %d snapshot in %.3fs", self.t.env.rank, cut, handle.snapshot_s)
        if stop:
            self.t.messenger.flush()  # downstream stages still need what was sent before the cut
            remaining = self.preemption.remaining_s() if self.preemption and self.preemption.requested else self.config.grace_s
            self.writer.flush(timeout=max(1.0, remaining - 1.0))
            raise Preempted(f"preempted: checkpoint {cut} saved; stopping (resume redoes no update)")

    def metrics(self) -> dict[str, Any]:
        """Checkpoint figures for the metrics record: the last finished save's snapshot and persist times and
        the time since the last save known committed (or persisted, on ranks other than the committer)."""
        done = [h for h in self._handles if h.done() and h.ok]
        out: dict[str, Any] = {"checkpoints": len(done)}
        if done:
            last = done[-1]
            out["ckpt_snapshot_s"] = last.snapshot_s
            out["ckpt_persist_s"] = last.persist_s
        finished = [h for h in done if (h.committed if self.writer.is_committer else True)]
        base = finished[-1].finished_at if finished else None
        out["since_commit_s"] = time.time() - (base or self._started)
        return out

    def finish(self) -> None:
        """Wait for pending saves, and leave together: rank 0 may still be writing the last commit record
        (slow storage, retries), and the collective that follows must not time out waiting for it. The other
        ranks wait on the store, whose timeout is the commit timeout, not the process group's."""
        self.writer.flush(timeout=self.config.commit_timeout_s)
        store = self._attempt_store()
        if store is None or self.t.env.world_size == 1:
            return
        key = f"finished/{self.t.position}"
        if self.t.env.rank == 0:
            store.set(key, "1")
        else:
            store.wait([key], timedelta(seconds=self.config.commit_timeout_s + 30))

    def stop_without_save(self) -> None:
        raise Preempted("preempted: no emergency checkpoint fits in the grace period; stopping")

    def _maybe_corrupt(self, cut: int) -> None:
        """Fault injection (``corrupt``): at a save after checkpoint ``step``, damage this rank's part of the
        newest committed checkpoint and die (before this save can commit)."""
        if not any(f.kind == "corrupt" and f.step < cut for f in self.faults.faults):
            return
        # damage the checkpoint this rank saved last, once it is the newest committed one (waiting briefly for
        # its commit), so that the damaged checkpoint is the one a restart finds first
        newest = self.last_saved
        deadline = time.monotonic() + 5.0
        while newest not in list_committed(self.storage):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

        def damage() -> None:
            rel = part_data_path(newest, self.part)
            data = bytearray(self.storage.read_bytes(rel))
            data[len(data) // 2] ^= 0xFF
            self.storage.write_bytes(rel, bytes(data))

        self.faults.after_commit(newest, damage)

    def close(self) -> None:
        self.writer.close(timeout=self.config.commit_timeout_s)
        if self.preemption is not None:
            self.preemption.uninstall()
