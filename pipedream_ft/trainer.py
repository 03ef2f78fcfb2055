"""The trainer: builds a rank's part of the pipeline, runs its actions, and calls the hooks.

Semantics are those of the mode (see :mod:`pipedream_ft.pipeline.modes`): ``"stash"`` (PipeDream's weight
stashing, the default), ``"vertical"`` (vertical sync) or ``"flush"`` (synchronous minibatch SGD over windows
of ``flush_every`` minibatches). Replicated stages all-reduce their gradients among themselves before each
update; minibatches are dealt to replicas round-robin.

The pieces, each in its own module:

* :class:`~pipedream_ft.pipeline.topology.Topology` — the rank's stage, replica and peers, from the plan;
* :class:`~pipedream_ft.pipeline.state.StageState` — weights, versions, optimizer, RNG, position, extra state;
* :class:`~pipedream_ft.pipeline.executor.Executor` — forward, backward, update, the pre-flight check;
* :class:`~pipedream_ft.pipeline.connection.Connection` — the one communication handle, re-configured per epoch;
* :class:`~pipedream_ft.ft.checkpointer.Checkpointer` — cuts, saves, commits, resume;
* hooks — timeline, metrics, progress bar, watchdog, fault injection.

And the training features: data sources read once by stage 0 (:mod:`~pipedream_ft.pipeline.data`,
:mod:`~pipedream_ft.pipeline.sources`), the LR scheduler (:mod:`~pipedream_ft.pipeline.scheduler`), gradient
clipping (:mod:`~pipedream_ft.pipeline.stepper`), mixed precision (:mod:`~pipedream_ft.pipeline.precision`),
evaluation (:mod:`~pipedream_ft.pipeline.evaluate`) and the final model (:mod:`~pipedream_ft.pipeline.export`).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import sys
import time
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from partitioner.plan import Plan, PlanError
from profiler.profile import Profile

from .checkpoint import Storage
from .config import PipelineConfig, TrainResult, planned_schedule
from .env import DistEnv, read_env
from .errors import InvalidArgument, JobError, PipelineSetupError, mark_training, say
from .ft import cuts
from .ft.agreement import agree, data_fact, mode_fact, model_fact, plan_fact
from .ft.checkpointer import CheckpointConfig, Checkpointer, plan_hash, refuse_per_process
from .ft.inplace import InPlace
from .ft.recovery import Membership, store_connection
from .ft.replan import RePlanPolicy, load_replanned
from .ft.replan_control import Measure, RePlanControl
from .ft.coordination import Coordinator
from .ft.elastic import describe_plan, load_stored_profile, replan_for_world
from .ft.faults import FaultInjector
from .ft.watchdog import Watchdog, WatchdogHook
from .observe.hooks import MetricsHook, ProgressHook, TimelineHook
from .observe.metrics import MetricsWriter, summary_table
from .observe.timeline import TimelineRecorder
from .pipeline.comm import Messenger, PeerTimeoutError
from .pipeline.connection import Connection, backend_and_device
from .pipeline.data import CallableFeed, DataComponent, StreamFeed, target_links, training_feed
from .pipeline.evaluate import EvalResult, MetricFn, evaluate
from .pipeline.executor import DataFn, Executor, RankStats
from .pipeline.export import pretrained_of, save_model, save_pretrained
from .pipeline.group import CommGroup
from .pipeline.hooks import HookList, Hooks
from .pipeline.modes import MODES, Mode, make_mode
from .pipeline.precision import LossScale, LossScaler, autocast_context
from .pipeline.record import TrainRecord
from .schedules.actions import COMMUNICATION, Action
from .pipeline.scheduler import SchedulerFactory, attach_scheduler
from .pipeline.materialize import Init, has_meta, materialize_stage
from .pipeline.memory_report import ActivationMeter, MemoryReport, memory_report, resident_bytes
from .pipeline.stage import build_stage, executed_layers, model_layers
from .pipeline.state import StageState
from .pipeline.stepper import Stepper
from .pipeline.tied import TiedParameters, find_tied, tie_declared
from .pipeline.topology import Topology
from .pipeline.turns import Turns

__all__ = ["MODES", "EvalResult", "LossScale", "PipelineConfig", "RankStats", "TrainResult", "PipelineTrainer",
           "release_all"]

log = logging.getLogger(__name__)


class PipelineTrainer:
    """Runs this rank's stage of ``plan``.

    ``model`` is the whole model (an ``nn.Sequential`` or an fx-traceable module) or a zero-argument factory
    for it; only this rank's layers are kept. ``optimizer_factory(params)`` builds the stage's optimizer (it is
    not called for a stage without parameters); ``scheduler_factory(optimizer)``, if given, builds its LR
    scheduler, stepped after every update. ``profile`` (the model's profile) lets a job whose world size
    changed re-plan; with checkpointing it is also stored beside the checkpoints, so later attempts can re-plan
    without it. A parameter used by layers of several stages (tied embeddings) is kept equal on all of them
    (see :mod:`pipedream_ft.pipeline.tied`); ``tied_parameters`` also ties groups of distinct parameters by
    name (e.g. ``[["wte.weight", "lm_head.weight"]]``). A model built on the ``meta`` device (under
    ``torch.device("meta")``) costs nothing to build: only this rank's stage gets storage, with values from
    ``init`` (see :mod:`pipedream_ft.pipeline.materialize`: by default the model's own initialisation seeded per
    module from ``config.seed``; ``FromFile(path)`` reads only the stage's tensors from a weights file); ``init``
    given with a real model re-initialises the stage the same way. The trainer builds its own process groups (it
    does not need ``torch.distributed``'s default group); :meth:`close` releases them. Under a schedule that gives
    a process several stages (virtual stages), the call returns a :class:`~pipedream_ft.virtual.VirtualTrainer`
    with the same methods.
    """

    def __new__(cls, model: Any, plan: Plan, *, config: PipelineConfig | None = None, env: DistEnv | None = None,
                turns: Turns | None = None, **kwargs: Any) -> Any:
        """A :class:`~pipedream_ft.virtual.VirtualTrainer` instead when the schedule gives a process several of the
        plan's stages (see :mod:`pipedream_ft.virtual`)."""
        if cls is PipelineTrainer and turns is None:
            from .virtual import VirtualTrainer, runs_virtual

            config = config or PipelineConfig()
            if runs_virtual(planned_schedule(config.schedule, plan.settings)):
                env = env or read_env()
                if kwargs.get("checkpoint") is None and env.recovery != "in-place" and config.replan is None:
                    kwargs.pop("checkpoint", None)
                    return VirtualTrainer(model, plan, config=config, env=env, **kwargs)
                from .virtual_threads import ThreadedStages  # fault tolerance still runs a thread per stage

                return ThreadedStages(model, plan, config=config, env=env, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        plan: Plan,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        config: PipelineConfig | None = None,
        env: DistEnv | None = None,
        checkpoint: CheckpointConfig | None = None,
        extra_state: dict[str, Any] | None = None,
        profile: Profile | None = None,
        scheduler_factory: SchedulerFactory | None = None,
        tied_parameters: Sequence[Sequence[str]] = (),
        turns: Turns | None = None,
        init: Init | None = None,
    ) -> None:
        self.turns = turns
        """The turns this stage takes with the other stages of its process (virtual stages, see
        :mod:`pipedream_ft.virtual`); ``None``: the process runs this stage alone."""
        self.config = config = config or PipelineConfig()
        self._baseline = resident_bytes()  # before any weight: the memory report's baseline
        self.timeline: dict[str, float] = {"start": time.time()}
        """Wall-clock times of this process's milestones: start, joined (its process groups built), restored,
        first_update; for a replacement process also joining and formed (in-place recovery)."""
        self.env = env = env or read_env()
        self.backend, self.device = backend_and_device(env.local_rank, config.backend)
        if not isinstance(model, nn.Module):
            model = model()
        if tied_parameters:
            tie_declared(model, tied_parameters)
        ml = model_layers(model)
        self._pretrained = pretrained_of(model)  # a transformers model's config, for save_pretrained
        model_hash = None
        if config.check_model_hash:
            from profiler.layers import structure_profile

            model_hash = structure_profile(model).structure_hash()
        self.profile = profile
        if profile is not None and profile.structure_hash() != plan.profile_hash:
            raise PlanError(f"the profile (hash {profile.structure_hash()[:12]}) is not the plan's model "
                            f"(hash {plan.profile_hash[:12]})")
        self.original_plan = plan
        self.mode: Mode = make_mode(config.mode, config.flush_every, config.update_every,
                                    planned_schedule(config.schedule, plan.settings))
        if plan.world_size != env.world_size and len(ml.names) == plan.num_layers:
            plan = replan_for_world(plan, self.profile, env.world_size, rank=env.rank,
                                    storage=Storage(checkpoint.url, checkpoint.storage_options)
                                    if checkpoint is not None and checkpoint.url is not None else None)
        elif checkpoint is not None and checkpoint.url is not None:
            replanned = load_replanned(Storage(checkpoint.url, checkpoint.storage_options), plan,
                                       lambda p: plan_hash(p, self.mode))
            if replanned is not plan and env.rank == 0:
                say(f"pipedream-ft: the job re-planned {describe_plan(plan)} into {describe_plan(replanned)}; "
                    "continuing on it", sys.stdout)
            plan = replanned
        plan.check_fits(profile_hash=model_hash, num_layers=len(ml.names), world_size=env.world_size)
        self.plan = plan
        self.topo = topo = Topology.of(plan, env.rank)
        self.mode.check(topo)
        self.connection = Connection(
            rank=env.rank, world_size=env.world_size, backend=self.backend, device=self.device,
            timeout_s=config.timeout_s, replica_ranks=topo.stage_ranks,
            links=lambda: topo.links() + target_links(topo) + (self.state.tied.links() if self.state.tied else []))
        """This rank's one communication handle: every component talks through it; each epoch re-configures it."""
        module = build_stage(ml, plan, topo.stage)
        if init is not None or has_meta(model):  # only this stage's tensors get storage (and values)
            materialize_stage(model, [module], init=init, seed=config.seed, also=[ml.root])
        module = module.to(self.device)
        specs = find_tied(ml, executed_layers(ml, plan.layer_to_stage, plan.num_stages, plan.recompute))
        tied = None
        if any(topo.stage in spec.stages for spec in specs):
            objects = dict(ml.root.named_parameters(remove_duplicate=False))
            tied = TiedParameters(specs, objects, module, topo, self.mode, optimizer_factory,
                                  connection=self.connection)
        self.tied_specs = specs
        self.facts = {"plan": plan_fact(plan), "model": model_fact(ml.names, ml.root),
                      "mode": mode_fact({"mode": repr(self.mode), "update_every": config.update_every,
                                         "clip_grad_norm": config.clip_grad_norm, "autocast": config.autocast_dtype,
                                         "compensation": config.compensation}),
                      "data": data_fact(seed=config.seed, checkpoint_url=checkpoint.url if checkpoint else None)}
        """What every rank must hold the same of, checked at start-up (see :mod:`pipedream_ft.ft.agreement`)."""
        del ml, model
        self.state = StageState(module, optimizer_factory, stage=topo.stage, replica=topo.replica,
                                keep=self.mode.versions_kept(topo), extra=extra_state, tied=tied)
        self._meter = ActivationMeter(self._weight_tensors)
        self._meter.attach(module)
        if tied is not None and scheduler_factory is not None:
            tied.attach_schedulers(scheduler_factory)
        scheduler = attach_scheduler(self.state, scheduler_factory, optimizer_factory)
        self.scheduler: Any = scheduler.scheduler if scheduler is not None else None
        """This stage's LR scheduler (``None`` without ``scheduler_factory`` or parameters)."""
        self.scaler = LossScaler(config.loss_scale) if config.autocast_dtype == torch.float16 else None
        if self.scaler is not None:
            self.state.components["loss_scale"] = self.scaler
        self.data_state = DataComponent()
        if topo.is_first:
            self.state.components["data"] = self.data_state
        self._feed: CallableFeed | StreamFeed | None = None
        self.loss_fn = loss_fn
        self.in_place = env.recovery == "in-place"
        if self.in_place and checkpoint is None:
            checkpoint = CheckpointConfig()  # in-place recovery needs the memory tier at least
        if checkpoint is not None and checkpoint.url is not None:
            refuse_per_process(Storage(checkpoint.url, checkpoint.storage_options))
        # every check above is local and the same on every rank; only now talk to the others
        self.coordinator = Coordinator(env, config.timeout_s)
        self.hooks = HookList()
        self.faults = FaultInjector.from_env(rank=env.rank, attempt=env.restart_count,
                                             connect=lambda: store_connection(env, config.timeout_s),
                                             key_prefix=f"pipedream-ft/{env.run_id}/faults")
        if self.faults:
            self.hooks.add(self.faults)
        self._add_observers()
        self.hooks.add(self._meter)
        self.record = TrainRecord(lambda: self.executor.losses)
        self.state.components["record"] = self.record  # a restored part brings its call's loss history back
        self.stepper = Stepper(self.state, topo=topo, synchronous=not self.mode.asynchronous,
                               connection=self.connection, clip_grad_norm=config.clip_grad_norm, scaler=self.scaler,
                               scheduler=scheduler, compensation=config.compensation, delay=self.mode.delay(topo))
        self.ckpt: Checkpointer | None = None
        if checkpoint is not None:
            self.ckpt = Checkpointer(checkpoint, topo=topo, mode=self.mode, state=self.state,
                                     coordinator=self.coordinator, hooks=self.hooks, connection=self.connection,
                                     profile=profile, job=self.coordinator.job_id(),
                                     faults=self.faults if self.faults.checkpoint_faults else None)
        scaler = self.scaler
        self.executor = Executor(topo, self.state, self.mode, connection=self.connection, device=self.device,
                                 loss_fn=loss_fn, seed=config.seed, hooks=self.hooks, step=self.stepper.step,
                                 autocast=autocast_context(config.autocast_dtype, self.device),
                                 loss_factor=(lambda: scaler.scale) if scaler is not None else None,
                                 decide=self.ckpt.decide if self.ckpt is not None and topo.is_first else None,
                                 on_cut=self.ckpt.on_cut if self.ckpt is not None else None, stops=cuts.stops)
        if config.replan is not None:
            self._start_replanning(config.replan)
        self.fingerprint = hashlib.sha256(json.dumps(
            [plan_hash(plan, self.mode), plan.profile_hash, checkpoint.url if checkpoint else None]).encode()).hexdigest()
        self.inplace: InPlace | None = None
        """This rank's part in in-place recovery (see :mod:`pipedream_ft.ft.inplace`); ``None`` without it."""
        if self.in_place:
            self.inplace = InPlace(env, coordinator=self.coordinator, checkpointer=self.ckpt, faults=self.faults,
                                   hooks=self.hooks, fingerprint=self.fingerprint, timeout_s=config.timeout_s,
                                   recovery_timeout_s=config.recovery_timeout_s, hang_s=config.hang_s)
        self._side = _PipelineSide(self)
        self.redone = 0
        self.resumed_from = self._start()
        self.timeline["restored"] = time.time()
        self.hooks.on_event("start", attempt=env.restart_count, resumed_from=self.resumed_from)
        if self.resumed_from is not None:
            self._log_resume()
        _OPEN.add(self)

    # -- set-up ---------------------------------------------------------------------------------------------

    def _start(self) -> int | None:
        """Join the group and restore what there is to restore; returns the position resumed from (or None).

        A replacement process (in-place recovery) joins the running group's next epoch and restores the cut
        every rank agrees on; any other process agrees on a fresh namespace with every rank of its attempt and,
        with checkpointing, resumes from the newest checkpoint they can all restore."""
        env = self.env
        if self.inplace is not None and env.incarnation > 0 and env.live_round:
            return self.inplace.join(self._side, env.live_round, self.timeline).cut
        epoch = self.coordinator.new_epoch()
        agree(epoch.store, rank=env.rank, world_size=env.world_size, facts=self.facts, timeout_s=self.config.timeout_s)
        self._connect(epoch.store)
        if self.inplace is not None:
            self.inplace.enter(epoch.id).start()
        return self.ckpt.resume() if self.ckpt is not None else None

    def _start_replanning(self, policy: RePlanPolicy) -> None:
        """Measure this stage's costs (every rank) and decide re-plans (rank 0); see
        :mod:`pipedream_ft.ft.replan_control`."""
        if self.ckpt is None or self.ckpt.storage is None:
            raise PipelineSetupError("re-planning needs a durable checkpoint tier (CheckpointConfig(url=...)): the "
                                     "new plan starts from a checkpoint resharded into it")
        if self.profile is None:
            self.profile = load_stored_profile(self.ckpt.storage)
        key = plan_hash(self.plan, self.mode)
        self.hooks.add(Measure(policy, lambda: self.executor.stats, self.topo.stage,
                               lambda value: self.coordinator.publish_measurement(key, value)))
        if self.topo.rank == 0:
            control = RePlanControl(policy, plan=self.plan, profile=self.profile, key=key,
                                    world_size=self.env.world_size, coordinator=self.coordinator,
                                    storage=self.ckpt.storage)
            self.ckpt.replan_due = control.due

    def _connect(self, store: Any, cancelled: Callable[[], bool] | None = None) -> None:
        """Form this epoch's process groups in namespace ``store`` (see :class:`CommGroup` for ``cancelled``)."""
        self.connection.configure(store, cancelled)
        self.timeline["joined"] = time.time()
        log.info("rank %d/%d joined (%s, restart %d, process %d)", self.env.rank, self.env.world_size,
                 self.backend, self.env.restart_count, self.env.incarnation)

    def _release(self) -> None:
        """Let go of this epoch's groups and of every pending operation on them: their connections close, so
        every rank still waiting on this one fails at once and joins the recovery too."""
        self.executor.abandon()
        self.connection.release()

    @property
    def group(self) -> CommGroup:
        """The current epoch's process groups (:class:`NotConnectedError` between epochs)."""
        return self.connection.group

    @property
    def messenger(self) -> Messenger:
        """The current epoch's messenger (:class:`NotConnectedError` between epochs)."""
        return self.connection.messenger

    def _recover(self, failure: str) -> None:
        """A peer failed: recover in place (see :mod:`pipedream_ft.ft.inplace`), then count the work redone."""
        assert self.inplace is not None
        reached = max([b for b, _ in self.executor.losses], default=self.position)
        formed, _ = self.inplace.recover(self._side, failure)
        if self.topo.is_last:
            self.redone = max(0, reached + 1 - formed.cut)

    @property
    def membership(self) -> Membership | None:
        """This rank's membership of the in-place recovery's epochs (``None`` without in-place recovery)."""
        return self.inplace.membership if self.inplace is not None else None

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """One record per in-place recovery this process took part in: wall-clock times of the failure, the
        group formed again, the state restored and the first update after it; the epoch and the cut."""
        return self.inplace.records if self.inplace is not None else []

    def _add_observers(self) -> None:
        config, env, topo = self.config, self.env, self.topo
        if config.watchdog_s:
            self.hooks.add(WatchdogHook(Watchdog(config.watchdog_s, rank=env.rank, health_file=config.health_file),
                                        topo.stage))
        if config.trace_dir:
            turns = self.turns  # a stage of several in one process: drawn on the process's row
            row = (turns.rank, f"rank {turns.rank} · stages {', '.join(map(str, turns.stages))}") if turns else None
            self.hooks.add(TimelineHook(TimelineRecorder(config.trace_dir, rank=env.rank, stage=topo.stage,
                                                         replica=topo.replica, attempt=env.restart_count,
                                                         process=env.incarnation, row=row),
                                        topo.replica))
        if config.metrics_dir:
            self.hooks.add(MetricsHook(MetricsWriter(config.metrics_dir, env.rank), rank=env.rank, stage=topo.stage,
                                       attempt=env.restart_count, stats=lambda: self.executor.stats,
                                       last_loss=self._last_loss, extra=self._metrics_extra))
        reporter = topo.is_last and topo.replica == 0
        self.progress = ProgressHook(bar=config.progress and env.rank == 0,
                                     report=self.coordinator.report_progress if reporter else None,
                                     last_loss=self._last_loss, reported_loss=self.coordinator.last_loss)
        self.hooks.add(self.progress)
        self.hooks.add(_Milestones(self.timeline, lambda: self.recoveries))

    def _last_loss(self) -> float | None:
        losses = self.executor.losses
        return losses[-1][1] if self.topo.is_last and losses else None

    def _metrics_extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {"restarts": self.env.restart_count, "redone": self.redone,
                               "recoveries": self.membership.epoch if self.membership is not None else 0}
        if self.ckpt is not None:
            out.update(self.ckpt.metrics())
        return out

    def _log_resume(self) -> None:
        """Say where this attempt resumes and how much work the failed one loses (it reported its progress)."""
        reached = self.coordinator.progress() if self.env.restart_count > 0 else None
        self.redone = max(0, reached - self.position) if reached is not None else 0
        if self.env.rank == 0:
            redone = f"; the failed attempt had reached minibatch {reached}, so {self.redone} minibatches are redone" \
                if reached is not None else ""
            log.warning("attempt %d resumes from committed checkpoint at minibatch %d (update %d)%s",
                        self.env.restart_count, self.position, self.state.versions.current.updates, redone)
            say(f"pipedream-ft: resumed from checkpoint {self.position} (attempt {self.env.restart_count})"
                + (f"; redoing {self.redone} minibatches" if reached is not None else ""), sys.stdout)

    # -- views ----------------------------------------------------------------------------------------------

    @property
    def position(self) -> int:
        """Minibatches trained so far (the data position)."""
        return self.state.position

    @property
    def stage_index(self) -> int:
        return self.topo.stage

    @property
    def replica(self) -> int:
        return self.topo.replica

    @property
    def is_first(self) -> bool:
        return self.topo.is_first

    @property
    def is_last(self) -> bool:
        return self.topo.is_last

    @property
    def module(self) -> nn.Module:
        return self.state.module

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.state.optimizer

    @property
    def stats(self) -> RankStats:
        return self.executor.stats

    # -- training -------------------------------------------------------------------------------------------

    def _feed_for(self, data: Any, steps: int) -> CallableFeed | StreamFeed:
        self._feed = training_feed(data, self._feed, topo=self.topo, connection=self.connection,
                                   component=self.data_state, position=self.position, steps=steps,
                                   checkpointing=self.ckpt is not None)
        return self._feed

    def preflight(self, data: DataFn | Any) -> None:
        """Check every stage on one minibatch before training (see :meth:`Executor.preflight`). A collective."""
        feed = self._feed_for(data, 0)
        feed.prepare(self.position)
        self.executor.preflight(feed)

    def schedule(self, start: int, stop: int) -> list[Action]:
        return self.mode.schedule(self.topo, start, stop)

    def train(self, data: DataFn | Any, steps: int) -> TrainResult:
        """Train minibatches ``position .. position + steps - 1`` and drain the pipeline. A collective.

        ``data`` is a callable ``data(b) -> (inputs, targets)``, a ``DataLoader``, torchdata's
        ``StatefulDataLoader`` or any iterable of ``(inputs, targets)`` minibatches (see
        :mod:`pipedream_ft.pipeline.sources`); every rank passes its own, identical one. ``steps`` counts
        minibatches (PipeDream's unit of work; in ``"flush"`` mode, ``flush_every`` of them make one optimizer
        step) and must be a multiple of the mode's window (every stage's replica count). With in-place recovery
        a peer's failure does not end the call: the ranks fall back to the newest cut they can all restore and
        go on (see :mod:`pipedream_ft.ft.recovery`).
        """
        return self._train(data, steps, finish=False)

    def _train(self, data: DataFn | Any, steps: int, *, finish: bool) -> TrainResult:
        """:meth:`train`; with ``finish``, also wait for the pending checkpoints to commit (see :meth:`fit`)."""
        window = self.mode.window(self.topo)
        if steps < 0 or steps % window:
            raise InvalidArgument(f"steps must be a non-negative multiple of {window} for this plan and mode, "
                                  f"got {steps}")
        ex = self.executor
        self._feed_for(data, steps)
        stop = self.position + steps
        t0 = time.perf_counter()
        began = self.position
        start, ex.losses = self.record.begin(began, stop)
        if steps:
            self._keep_start_cut()
        self.hooks.on_train_start(start, stop)
        mark_training()  # an error from now on is a crash, not a set-up error (see pipedream_ft.crashlog)
        try:
            while True:
                failure = self._run(data, stop)
                if failure is None:
                    self.hooks.on_event("gathering")
                    failure, losses = self._gather_losses()
                    trained = time.perf_counter()  # the result's time: training, not the checkpoints' commit
                if failure is None and finish:
                    self.hooks.on_event("finishing")
                    failure = self._finish_checkpoints(stop)
                if failure is None:
                    break
                self._recover(failure)
        except BaseException:
            if self.ckpt is not None:  # nothing is left to save: SIGTERM ends the process again
                self.ckpt.stand_down()
            raise
        finally:
            self.record.end()
            self.hooks.on_train_end(start, stop)
        self.state.position = stop
        self.progress.report(stop, force=True)
        seconds = trained - t0
        result = TrainResult(losses, start, seconds, ex.stats, trained=stop - began)
        if self.config.summary:
            self._print_summary(seconds)
        return result

    def _keep_start_cut(self) -> None:
        """With in-place recovery, make the position training starts from a cut of the memory tier (unless this
        rank's part of it is there already), and wait until it is stored: so there is always a cut that every rank
        can restore, even when a rank fails before the policy's first one (a replacement could rebuild the initial
        state, but the survivors no longer have it)."""
        ckpt = self.ckpt
        if self.membership is None or ckpt is None or ckpt.memory is None or ckpt.memory_tier is None:
            return
        if self.position not in ckpt.memory_tier.steps([ckpt.part]):
            ckpt.on_cut(self.position, 0)
        ckpt.flush_memory(timeout=ckpt.config.commit_timeout_s)

    def _run(self, data: DataFn, stop: int) -> str | None:
        """Run the schedule from the current position to ``stop``. Returns ``None`` when done, or — with in-place
        recovery — why the group failed (the exception and its frames, which hold pending operations, are gone
        by the time the caller recovers)."""
        ex, turns = self.executor, self.turns
        try:
            feed = self._feed
            assert feed is not None
            if not ex.preflight_done:
                feed.prepare(self.position)
                ex.preflight(feed)
            actions = self.mode.lowered(self.topo, self.position, stop)
            if turns is not None:
                turns.begin(self.topo.stage, self.position, stop)
            for action in actions:
                self.hooks.on_action(action)
                # a send or a receive only posts its message: it takes no turn (virtual stages)
                with turns.turn(action) if turns is not None and action.kind not in COMMUNICATION \
                        else contextlib.nullcontext():
                    ex.run(action, feed)
                if self.ckpt is not None:
                    self.ckpt.announce_preemption()
            if self.state.tied:
                self.state.tied.drain(stop // self.mode.update_unit(self.topo))
            self.hooks.on_event("draining")
            self.connection.flush()
            self.faults.at_drained()
            return None
        except PipelineSetupError as exc:  # found here; any recovery would meet it again: the whole group stops
            if exc.agreed:  # every rank holds this same line already (the pre-flight's check is a collective)
                raise
            self.coordinator.publish_job_error(str(exc))
            error = self.coordinator.job_error()  # as every rank reads it (the first published), for the same line
            if error is not None:
                raise JobError(error) from exc
            raise
        except PeerTimeoutError as exc:
            return self._peer_failure(exc)
        finally:
            if turns is not None:
                turns.leave(self.topo.stage)

    def _peer_failure(self, exc: PeerTimeoutError) -> str:
        """A peer's failure seen by :meth:`_run` or :meth:`_gather_losses`: the job's error if one was published
        (raised as :class:`JobError`), else — with in-place recovery — the reason to recover with; without it,
        ``exc`` is raised again."""
        error = self.coordinator.job_error()
        if error is not None:
            raise JobError(error) from None
        if self.membership is None:
            raise exc
        return str(exc)

    def _gather_losses(self) -> tuple[str | None, list[float]]:
        """Every minibatch's loss of the call, on every rank; or — with in-place recovery — why the group failed
        while gathering them. The gather is the last collective of the recoverable region: a peer that dies while
        the others wait here (they finished their last minibatch, it had not) is recovered like one that dies
        while they train, instead of failing the ranks that were done."""
        try:
            return None, self.executor.gather_losses()
        except PeerTimeoutError as exc:
            return self._peer_failure(exc), []

    def _finish_checkpoints(self, position: int) -> str | None:
        """Wait for the pending checkpoints to commit (see :meth:`Checkpointer.finish`); ``None`` when done, or
        — with in-place recovery — why the group failed meanwhile: the end of a ``fit`` is recoverable too, so a
        peer that dies while writing its part of the last checkpoint is replaced and the part written again."""
        assert self.ckpt is not None
        self.faults.at_finishing(self.env.world_size)
        try:
            self.ckpt.finish(position, failed=self.inplace.peer_failed if self.inplace is not None else None)
            return None
        except PeerTimeoutError as exc:
            return self._peer_failure(exc)

    def _print_summary(self, seconds: float) -> None:
        """Gather every rank's statistics and print a table on rank 0. A collective."""
        rows = self.group.all_gather_object({**self._stats_row(), "seconds": seconds})
        if self.env.rank == 0:
            print(summary_table(rows), flush=True)

    def fit(self, data: DataFn | Any, total: int) -> TrainResult:
        """Train until ``total`` minibatches are done in all, continuing from a resumed checkpoint's position;
        then wait for pending checkpoints to commit. A collective."""
        result = self._train(data, max(0, total - self.position), finish=self.ckpt is not None)
        if self.ckpt is not None and self.env.local_rank == 0:  # everybody on this node is done with the memory tier
            self.ckpt.discard_memory()
        return result

    # -- results --------------------------------------------------------------------------------------------

    def gather_stats(self) -> list[dict[str, Any]]:
        """Every rank's :class:`RankStats` of the last :meth:`train` (as dicts, with its rank and stage, and under
        ``"memory"`` its :meth:`memory_report` as a dict), in rank order, on every rank. A collective."""
        return self.group.all_gather_object({**self._stats_row(), "memory": self.memory_report().as_dict()})

    def _weight_tensors(self) -> list[torch.Tensor]:
        """The weight versions this stage keeps (what a forward reads as weights besides its parameters)."""
        versions = self.state.versions
        tied = self.state.tied
        kept = [versions.current, *versions.history.values()]
        if tied:
            kept += [v for g in tied.groups for v in (g.versions.current, *g.versions.history.values())]
        return [t for v in kept for t in v.tensors]

    def memory_report(self) -> MemoryReport:
        """This process's memory: its stage's weights, gradients, optimizer state, weight versions and in-flight
        activations against its peak and the plan's prediction (see :mod:`pipedream_ft.pipeline.memory_report`)."""
        predicted = None
        if self.profile is not None:
            from partitioner.cost import stage_memory

            layers = [self.profile.layers[i] for i in self.plan.stages[self.topo.stage].layers]
            predicted = float(stage_memory(sum(layer.parameter_bytes for layer in layers),
                                           sum(layer.activation_bytes for layer in layers),
                                           self.plan.num_stages - self.topo.stage))
        tied = self.state.tied
        return memory_report(stage=self.topo.stage, module=self.state.module,
                             optimizers=[self.state.optimizer, *(g.optimizer for g in (tied.groups if tied else []))],
                             trainable=self.state.all_live_params,
                             stash_bytes=self.executor.stats.peak_stash_bytes, meter=self._meter, device=self.device,
                             baseline=self._baseline, predicted=predicted,
                             limit=self.plan.settings.get("memory_bytes"))

    def _stats_row(self) -> dict[str, Any]:
        rank = self.turns.rank if self.turns is not None else self.env.rank  # a virtual stage's: its process's
        return {"rank": rank, "stage": self.topo.stage, **self.executor.stats.as_dict()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights (original keys), gathered from the stages onto every rank. A collective."""
        mine = {k: v.detach().cpu() for k, v in self.state.module.state_dict().items()} if self.topo.replica == 0 \
            else {}
        out: dict[str, torch.Tensor] = {}
        for part in self.group.all_gather_object(mine):
            out.update(part or {})
        return out

    def evaluate(self, data: DataFn | Any, steps: int, metric_fn: MetricFn | None = None) -> EvalResult:
        """Mean loss (and ``metric_fn(outputs, targets)`` per minibatch) of minibatches ``0 .. steps - 1`` of
        ``data``, forward only, in eval mode, with the current weights, changing nothing (see
        :mod:`pipedream_ft.pipeline.evaluate`); between :meth:`train` calls. A collective."""
        return evaluate(self.executor, data, steps, metric_fn,
                        training_source=self._feed.source if self._feed is not None else None)

    def save_model(self, path: str, format: str = "torch") -> None:
        """Write the whole model's weights to ``path`` as ``"safetensors"`` (each stage writes its own tensors into
        the one file; no process holds more than its stage) or ``"torch"`` (``torch.save``, gathered onto rank 0);
        the plain model's ``load_state_dict(strict=True)`` accepts the file (see
        :mod:`pipedream_ft.pipeline.export`). A collective."""
        save_model(self.messenger, self.state.module, replica=self.topo.replica, path=path, format=format,
                   stage=self.topo.stage)

    def save_pretrained(self, directory: str, max_shard_bytes: int = 5 * 10**9) -> None:
        """Write the whole model as a Hugging Face directory (config and safetensors shards, each stage writing its
        own) that ``AutoModelForCausalLM.from_pretrained(directory)`` loads with no missing or unexpected keys (see
        :func:`pipedream_ft.pipeline.export.save_pretrained`); for transformers models. A collective."""
        save_pretrained(self.messenger, self.state.module, replica=self.topo.replica, directory=directory,
                        pretrained=self._pretrained, max_shard_bytes=max_shard_bytes, stage=self.topo.stage)

    def close(self) -> None:
        """Wait for pending checkpoint commits, stop the background threads, close the traces, and shut this
        rank's process groups down (no backend thread outlives it). Idempotent."""
        try:
            if self.ckpt is not None:
                self.ckpt.close()  # raises if the last durable cut could not be committed
        finally:
            self.hooks.close()
            if self.inplace is not None:
                self.inplace.close()
            self.release()

    def release(self) -> None:
        """Shut this rank's process groups down now (idempotent; also done at interpreter exit)."""
        if self.connection.configured:
            self._release()
        _OPEN.discard(self)


_OPEN: weakref.WeakSet[PipelineTrainer] = weakref.WeakSet()


def release_all() -> None:
    """Shut down the process groups of every trainer of this process that is still open (called by
    :func:`pipedream_ft.launch` and :func:`~pipedream_ft.exit_on_error` on the way out, and at exit)."""
    for trainer in list(_OPEN):
        try:
            trainer.release()
        except Exception:  # the way out must not fail
            pass


atexit.register(release_all)


class _PipelineSide:
    """The trainer's side of an in-place recovery (:class:`~pipedream_ft.ft.inplace.Rebuildable`)."""

    def __init__(self, trainer: PipelineTrainer) -> None:
        self.t = trainer

    def release(self) -> None:
        self.t._release()

    def rebuild(self, store: Any, cancelled: Callable[[], bool]) -> None:
        self.t._connect(store, cancelled=cancelled)

    def restore(self, part: dict[str, Any]) -> None:
        self.t.state.restore(part)

    def rewind(self, cut: int) -> None:
        t = self.t
        t.executor.rewind(cut)
        feed = t._feed
        if isinstance(feed, StreamFeed):  # stage 0 reads the source again from the restored state
            feed.rewind()
            if t.topo.is_first:
                t.data_state.attach(feed, t.position)


class _Milestones(Hooks):
    """Records the first update of the process and the first one after each in-place recovery."""

    def __init__(self, timeline: dict[str, float], recoveries: Callable[[], list[dict[str, Any]]]) -> None:
        self.timeline = timeline
        self.recoveries = recoveries

    def on_update(self, round_: int, done: int, start: float, end: float) -> None:
        if "first_update" not in self.timeline:
            self.timeline["first_update"] = end
        records = self.recoveries()
        if records and "first_update" not in records[-1] and "restored" in records[-1]:
            records[-1]["first_update"] = end
