"""How the pipeline trains (:class:`PipelineConfig`), and what a call of
:meth:`~pipedream_ft.PipelineTrainer.train` returns (:class:`TrainResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .env import setting
from .ft.replan import RePlanPolicy
from .pipeline.compensation import Compensation, check_compensation
from .pipeline.executor import RankStats
from .pipeline.modes import MODES
from .pipeline.precision import LossScale, check_autocast
from .schedules.replicated import SYNCHRONOUS
from .schedules.window import VIRTUAL, ScheduleSpec, WindowSchedule, resolve_schedule

__all__ = ["PipelineConfig", "TrainResult", "check_schedule", "planned_schedule"]

PLANNED = "plan"
"""``PipelineConfig(schedule="plan")``: flush mode runs the schedule the plan records (:func:`planned_schedule`)."""


def planned_schedule(schedule: ScheduleSpec, settings: dict) -> ScheduleSpec:
    """``schedule`` as given, unless it is ``"plan"``: then the synchronous schedule ``pipedream-partition
    --schedule`` chose and recorded in a plan's ``settings`` (``settings["schedule"]["name"]``). Raises
    :class:`~partitioner.plan.PlanError`, saying what to pass instead, for a plan that records none, chose
    PipeDream's asynchronous 1F1B, or chose a table (whose path the plan does not hold)."""
    from partitioner.plan import PlanError

    if schedule != PLANNED:
        return schedule
    record = settings.get("schedule")
    name = record.get("name") if isinstance(record, dict) else None
    if not isinstance(name, str):
        raise PlanError("schedule 'plan': the plan records no schedule (pipedream-partition ... --schedule auto "
                         "records one); pass PipelineConfig(schedule=NAME)")
    if name == "pipedream":
        raise PlanError("schedule 'plan': the plan chose PipeDream's asynchronous 1F1B, which mode 'flush' does "
                         "not run; train it with PipelineConfig(mode='stash')")
    if name not in SYNCHRONOUS + VIRTUAL:
        raise PlanError(f"schedule 'plan': the plan chose the table {name!r}, which it does not hold; pass that "
                         "file's path as the schedule")
    return name



def check_schedule(schedule: str | WindowSchedule, mode: str, flush_every: int | None = None) -> None:
    """Raise ValueError, naming what runs, unless ``mode`` runs ``schedule`` (with ``flush_every`` minibatches
    per window, for a schedule given as data)."""
    if isinstance(schedule, WindowSchedule):
        if mode != "flush":
            raise ValueError(f"the schedule {schedule} is synchronous (mode 'flush'); mode {mode!r} runs "
                             "PipeDream's asynchronous 1F1B")
        if flush_every is not None:
            schedule.check_window(flush_every)
        return
    runnable = ", ".join(SYNCHRONOUS + VIRTUAL)
    if schedule == "pipedream":
        raise ValueError("schedule 'pipedream' is the asynchronous modes' (mode 'stash' or 'vertical'); mode "
                         f"'flush' runs {runnable}")
    if schedule not in SYNCHRONOUS + VIRTUAL:
        raise ValueError(f"schedule {schedule!r} is unknown; mode 'flush' runs {runnable}")
    if schedule != "1f1b" and mode != "flush":
        raise ValueError(f"schedule {schedule!r} is a synchronous schedule (mode 'flush'); mode {mode!r} runs "
                         "PipeDream's asynchronous 1F1B")


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """How the pipeline trains."""

    mode: str = "stash"
    """``"stash"`` (asynchronous 1F1B with weight stashing), ``"vertical"`` (plus vertical sync), ``"flush"`` or
    ``"2bw"`` (PipeDream-2BW, see :mod:`pipedream_ft.pipeline.modes`)."""
    flush_every: int = 4
    """Minibatches per optimizer step in ``"flush"`` mode."""
    schedule: ScheduleSpec = "1f1b"
    """The ``"flush"`` mode's schedule inside a window: ``"1f1b"``, ``"gpipe"`` or ``"zb_h1"`` (zero bubble:
    the backward split in two, see :mod:`pipedream_ft.pipeline.splitbackward`); one that gives a process several
    stages — ``"interleaved_1f1b"``, ``"interleaved_zero_bubble"``, ``"looped_bfs"``, ``"zbv"`` or ``"dualpipev"``,
    run by :mod:`pipedream_ft.virtual` on a plan of several stages per process; or one given as data — a table's
    path (``*.csv``) or a mapping rank -> actions, checked and held as a
    :class:`~pipedream_ft.schedules.WindowSchedule` whose window must be ``flush_every``; or ``"plan"``, the one
    ``pipedream-partition --schedule`` chose and recorded in the plan (see :func:`planned_schedule`). All give
    minibatch SGD. The asynchronous modes run PipeDream's 1F1B."""
    update_every: int | None = None
    """Minibatches per optimizer step in ``"2bw"`` mode (default: the number of stages)."""
    compensation: Compensation | None = None
    """Delay compensation in the asynchronous modes (see :mod:`pipedream_ft.pipeline.compensation`)."""
    timeout_s: float = 45.0
    """Longest wait for a peer (a transfer, an all-reduce) before the rank fails naming it."""
    watchdog_s: float | None = 60.0
    """Fail the rank if it makes no progress at all for this long while it trains (``None``: no watchdog). Waits
    that have deadlines of their own are not watched: an in-place recovery (``recovery_timeout_s``) and ``fit``'s
    wait for its last checkpoints to commit (``CheckpointConfig.commit_timeout_s``)."""
    health_file: str | None = field(default_factory=lambda: setting("PIPEDREAM_FT_HEALTH_FILE"))
    """Refreshed while the rank makes progress (for liveness probes); default ``$PIPEDREAM_FT_HEALTH_FILE``."""
    trace_dir: str | None = field(default_factory=lambda: setting("PIPEDREAM_FT_TRACE_DIR"))
    """Write this rank's timeline (Chrome/Perfetto trace) here; default ``$PIPEDREAM_FT_TRACE_DIR``."""
    metrics_dir: str | None = field(default_factory=lambda: setting("PIPEDREAM_FT_METRICS_DIR"))
    """Write this rank's metrics (JSON lines, one per update) here; default ``$PIPEDREAM_FT_METRICS_DIR``."""
    progress: bool = True
    """A progress bar on rank 0 (only when stderr is a terminal)."""
    summary: bool = True
    """Print a per-rank summary table on rank 0 at the end of :meth:`PipelineTrainer.train`."""
    seed: int = 0
    """Seeds each forward's RNG from (seed, stage, minibatch), so dropout is reproducible across restarts."""
    check_model_hash: bool = True
    """Refuse a plan whose profile hash differs from the model's structure."""
    backend: str | None = None
    """``"nccl"`` or ``"gloo"``; default NCCL when CUDA is available."""
    replan: RePlanPolicy | None = None
    """Re-plan from the costs measured while training (see :mod:`pipedream_ft.ft.replan`); ``None``: never."""
    recovery_timeout_s: float = 120.0
    """In-place recovery: the longest the ranks wait for the group to form again before giving up (then the
    processes stop and torchrun restarts them all)."""
    hang_s: float = 0.8
    """In-place recovery: a peer whose heartbeat (every 0.1 s, from a thread) has not changed for this long is
    taken as hung and replaced, whatever ``timeout_s`` is. Raise it for code that holds the GIL longer."""
    clip_grad_norm: float | None = None
    """Clip gradients to this 2-norm: per stage in the asynchronous modes, by the whole model's norm in
    ``"flush"`` mode (see :mod:`pipedream_ft.pipeline.stepper`)."""
    autocast_dtype: torch.dtype | None = None
    """Run forwards under ``torch.autocast`` with this dtype: ``torch.bfloat16``, or ``torch.float16`` in
    ``"flush"`` mode only, with loss scaling (see :mod:`pipedream_ft.pipeline.precision`)."""
    loss_scale: LossScale = field(default_factory=LossScale)
    """How the float16 loss scale starts and moves."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {self.flush_every}")
        if self.schedule == PLANNED:  # resolved against the plan by the trainer
            if self.mode != "flush":
                raise ValueError(f"schedule 'plan' is flush mode's schedule as the plan records it; mode {self.mode!r} "
                                 "runs PipeDream's asynchronous 1F1B")
        else:
            self.schedule = resolve_schedule(self.schedule)
            check_schedule(self.schedule, self.mode, self.flush_every)
        if self.update_every is not None and self.update_every < 1:
            raise ValueError(f"update_every must be >= 1, got {self.update_every}")
        check_compensation(self.compensation, self.mode)
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not self.hang_s > 0.2:
            raise ValueError(f"hang_s must exceed two heartbeat intervals (0.2 s), got {self.hang_s}")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {self.backend!r}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0, got {self.clip_grad_norm}")
        check_autocast(self.autocast_dtype, self.mode)


@dataclass(slots=True)
class TrainResult:
    """What :meth:`PipelineTrainer.train` returns on every rank."""

    losses: list[float]
    """Loss of each minibatch of the call, ``start`` onwards, in minibatch order: the whole history on every rank,
    also after a recovery that replaced processes (a replacement restores the losses before its cut with its
    checkpoint part, see :mod:`pipedream_ft.pipeline.record`)."""
    start: int
    """First minibatch number of this call (for a process that continues a call from a restored cut, the call's
    start, not the cut)."""
    seconds: float
    """Seconds this process spent in the call."""
    stats: RankStats = field(default_factory=RankStats)
    trained: int = 0
    """Minibatches this process took the call forward in ``seconds`` (from where it began, which is the restored
    cut for a replacement): the numerator of a throughput."""
