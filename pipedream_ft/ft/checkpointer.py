"""Consistent pipeline checkpoints without a global barrier, and exact resume.

**The cut.** A checkpoint is taken at a *cut* ``c``: a minibatch number that is a multiple of the mode's window
(every stage's replica count, and ``flush_every`` in flushing mode). Every rank saves right after its update for
the last minibatch before ``c`` — so every stage's part holds exactly the updates of minibatches ``0 .. c-1`` —
and the data position ``c``. Stage 0 decides (its policy, or a preemption notice) while it runs the forward of
minibatch ``c - 1`` and marks that minibatch's activation header; the mark reaches every later stage before
that stage's own update for ``c - 1``, so nobody stops to agree. Replicas of a stage that did not see the
marked minibatch learn of it in the same round's gradient all-reduce (see :mod:`pipedream_ft.pipeline.executor`).

**What is in flight.** At the cut, stage ``s`` has already run forwards of a few minibatches ``>= c`` whose
backwards are still to come. Its part also keeps the weight versions those forwards used (the stash). On
resume the schedule restarts at ``c``; its warm-up forwards recompute exactly those minibatches with the
stashed versions and the same per-minibatch RNG seeds, so everything after the cut is bitwise what the
uninterrupted run computed.

**Commit.** Each rank's part is persisted in the background (:class:`~pipedream_ft.checkpoint.CheckpointWriter`);
rank 0 writes the commit record once every part is durable. On start, the ranks agree on the newest
committed checkpoint whose every part verifies, and all load that one.

The checkpointer sees only the rank's :class:`~pipedream_ft.pipeline.state.StageState`, its
:class:`~pipedream_ft.pipeline.topology.Topology` and the mode's window.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from partitioner.plan import Plan
from profiler.profile import Profile

from ..checkpoint import (CheckpointError, CheckpointWriter, CorruptCheckpointError, Storage, list_committed,
                          load_part, read_commit)
from ..errors import PipelineError
from ..pipeline.executor import CUT, STOP
from ..pipeline.group import CommGroup
from ..pipeline.hooks import Hooks
from ..pipeline.modes import Flush, Mode
from ..pipeline.state import StageState
from ..pipeline.topology import Topology
from ..policies import CheckpointPolicy, EveryNSteps, PreemptionHandler
from .coordination import Coordinator
from .elastic import store_profile

__all__ = ["CheckpointConfig", "Checkpointer", "Preempted", "plan_hash", "part_name"]

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


def plan_hash(plan: Plan, mode: Mode) -> str:
    """Identifies the plan and training semantics a checkpoint was written under."""
    body = {
        "profile_hash": plan.profile_hash,
        "stages": [[list(s.layers), s.replicas] for s in plan.stages],
        "mode": mode.name,
        "flush_every": mode.flush_every if isinstance(mode, Flush) else None,
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def part_name(stage: int, replica: int) -> str:
    return f"stage{stage}-replica{replica}"


class Checkpointer:
    """One rank's side of checkpointing: deciding (stage 0), saving, committing (rank 0) and resuming."""

    def __init__(self, config: CheckpointConfig, *, topo: Topology, mode: Mode, state: StageState,
                 group: CommGroup, coordinator: Coordinator, hooks: Hooks, flush_sends: Callable[[], None],
                 profile: Profile | None = None) -> None:
        self.config = config
        self.topo = topo
        self.mode = mode
        self.state = state
        self.group = group
        self.coordinator = coordinator
        self.hooks = hooks
        self.flush_sends = flush_sends
        self.before_save: Callable[[int], None] | None = None
        """Called with the cut before each save (fault injection uses it)."""
        self.storage = Storage(config.url, config.storage_options)
        self.storage.check_writable()
        plan = topo.plan
        self.part = part_name(topo.stage, topo.replica)
        parts = [part_name(s.index, i) for s in plan.stages for i in range(s.replicas)]
        self.plan_hash = plan_hash(plan, mode)
        self.metadata = {"plan_hash": self.plan_hash, "profile_hash": plan.profile_hash,
                         "world_size": plan.world_size, "num_stages": plan.num_stages,
                         "stages": [[list(s.layers), s.replicas] for s in plan.stages]}
        if profile is not None and topo.rank == 0:
            store_profile(self.storage, profile)
        self.writer = CheckpointWriter(self.storage, self.part, expected_parts=parts, is_committer=topo.rank == 0,
                                       keep=config.keep, commit_timeout_s=config.commit_timeout_s,
                                       metadata=self.metadata)
        self.window = mode.window(topo)
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
        """Load the newest checkpoint every rank can verify; return the position to continue from, or ``None``.
        A collective."""
        if not self.config.resume:
            return None
        committed = self.group.all_gather_object(list_committed(self.storage) if self.topo.rank == 0 else None)[0]
        topo = self.topo
        for step in reversed(committed):
            parts: list[dict[str, Any]] = []
            problem = ""
            resharded = False
            try:
                record = read_commit(self.storage, step)
                meta = record.metadata
                if meta.get("plan_hash") == self.plan_hash:
                    parts = [load_part(self.storage, step, self.part, record=record)]
                elif meta.get("profile_hash") == topo.plan.profile_hash and "stages" in meta:
                    resharded = True  # written under another plan of the same model: gather my layers
                    mine = set(topo.layers)
                    for index, (layers, _replicas) in enumerate(meta["stages"]):
                        if mine & set(layers) or (index == 0 and self.state.extra):
                            parts.append(load_part(self.storage, step, part_name(index, 0), record=record))
                else:
                    raise CheckpointError(
                        f"checkpoint {step} in {self.storage.url} was written for another model (profile hash "
                        f"{str(meta.get('profile_hash'))[:12]}, this model's {topo.plan.profile_hash[:12]}); "
                        "use another checkpoint directory"
                    )
            except CorruptCheckpointError as exc:
                problem = str(exc)
            bad = [f for f in self.group.all_gather_object(problem) if f]
            if bad:
                log.warning("checkpoint %d is not usable (%s); trying an older one", step, bad[0])
                continue
            if resharded:
                start = self.state.reshard(parts, step, updates_per_round=self.mode.update_unit(topo),
                                           window=self.window)
                if topo.rank == 0:
                    if start != step:
                        log.warning("the new plan's replica counts need a start at a multiple of %d: minibatches "
                                    "%d..%d are skipped", self.window, step, start - 1)
                    old = record.metadata["stages"]
                    msg = (f"checkpoint {step} was written by a {len(old)}-stage plan on "
                           f"{record.metadata.get('world_size')} workers; resharded into "
                           f"{topo.num_stages} stages on {topo.world_size} workers")
                    log.warning(msg)
                    print(f"pipedream-ft: {msg}", flush=True)
            else:
                self.state.restore(parts[0])
                start = step
            self.last_cut = start
            self.config.policy.reset(time.monotonic(), start)
            return start
        return None

    # -- deciding (stage 0) ---------------------------------------------------------------------------------

    def decide(self, b: int) -> int:
        """At stage 0's forward of minibatch ``b``: the cut flags for a cut at ``b + 1`` (0: none)."""
        now = time.monotonic()
        self.config.policy.observe(step_time_s=now - self._last_forward)
        self._last_forward = now
        cut = b + 1
        if cut % self.window or cut <= self.last_cut:
            return 0
        if self.preemption_requested(now):
            assert self.preemption is not None
            self.last_cut = cut  # no further decisions: this is the last cut of the attempt
            if self.preemption.fits(self.last_save_s * 2 + 1.0, now=now):
                self.config.policy.record_save(cut, now)
                return CUT | STOP
            raise Preempted("preempted: no emergency checkpoint fits in the grace period; stopping")
        if self.config.policy.should_save(cut, now):
            self.last_cut = cut
            return CUT
        return 0

    def preemption_requested(self, now: float | None = None) -> bool:
        """A preemption notice here, or announced by another rank through the store (checked every 50 ms)."""
        if self.preemption is None:
            return False
        if self.preemption.requested:
            return True
        now = time.monotonic() if now is None else now
        if now - self._last_store_check > 0.05:
            self._last_store_check = now
            return self.coordinator.preemption_announced()
        return False

    def announce_preemption(self) -> None:
        """Called on any rank after each action: tell stage 0 (through the store) that SIGTERM arrived."""
        if self.preemption is not None and self.preemption.requested and not self._announced:
            self._announced = True
            log.warning("rank %d: preemption notice received; asking for an emergency checkpoint", self.topo.rank)
            self.coordinator.announce_preemption()

    # -- saving ---------------------------------------------------------------------------------------------

    def on_cut(self, cut: int, flags: int) -> None:
        """This rank's update for minibatch ``cut - 1`` is done: save its part (and stop, for a preemption)."""
        if self.before_save is not None:
            self.before_save(cut)
        t0 = time.perf_counter()
        w0 = time.time()
        handle = self.writer.save(cut, self.state.capture(cut))
        self.last_save_s = time.perf_counter() - t0
        self.last_cut = max(self.last_cut, cut)
        self.last_saved = cut
        self._handles.append(handle)
        del self._handles[:-4]
        self.hooks.on_checkpoint(cut, w0, time.time(), handle.snapshot_s)
        if self.topo.is_first:
            self.config.policy.observe(checkpoint_cost_s=handle.snapshot_s)
        log.info("rank %d: checkpoint %d snapshot in %.3fs", self.topo.rank, cut, handle.snapshot_s)
        if flags & STOP:
            self.flush_sends()  # downstream stages still need what was sent before the cut
            remaining = self.preemption.remaining_s() if self.preemption and self.preemption.requested \
                else self.config.grace_s
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

    def finish(self, position: int) -> None:
        """Wait for pending saves, and leave together: rank 0 may still be writing the last commit record
        (slow storage, retries), and the collective that follows must not time out waiting for it. The other
        ranks wait on the store, whose timeout is the commit timeout, not the process group's."""
        self.writer.flush(timeout=self.config.commit_timeout_s)
        self.coordinator.leave_together(position, self.config.commit_timeout_s + 30)

    def close(self) -> None:
        self.writer.close(timeout=self.config.commit_timeout_s)
        if self.preemption is not None:
            self.preemption.uninstall()
