"""The trainer: builds a process's part of the pipeline (one stage, or several), runs its actions, and calls the hooks.

Semantics are those of the mode (see :mod:`pipedream_ft.pipeline.modes`): ``"stash"`` (PipeDream's weight
stashing, the default), ``"vertical"`` (vertical sync) or ``"flush"`` (synchronous minibatch SGD over windows
of ``flush_every`` minibatches). Replicated stages all-reduce their gradients among themselves before each
update; minibatches are dealt to replicas round-robin.

The pieces, each in its own module:

* :class:`~pipedream_ft.pipeline.topology.Topology` — a stage's place: its replica and peers, from the plan;
* :class:`~pipedream_ft.pipeline.state.StageState` — weights, versions, optimizer, RNG, position, extra state;
* :class:`~pipedream_ft.pipeline.executor.Executor` — forward, backward, update, the pre-flight check;
* :class:`~pipedream_ft.pipeline.connection.Connection` — the one communication handle, re-configured per epoch;
* :class:`~pipedream_ft.ft.checkpointer.Checkpointer` — cuts, saves, commits, resume;
* hooks — timeline, metrics, progress bar, watchdog, fault injection.

A process holds one stage, or — under a schedule that gives a process several (interleaved 1F1B, ZBV,
DualPipeV: :mod:`pipedream_ft.virtual`) — several, each with its own state, stepper and executor, all on the
process's one rank and one thread: the process runs one lowered action list, and every action goes to its
stage's executor. The checkpointer, in-place recovery, hooks and connection are the process's.

And the training features: data sources read once by stage 0 (:mod:`~pipedream_ft.pipeline.data`,
:mod:`~pipedream_ft.pipeline.sources`), the LR scheduler (:mod:`~pipedream_ft.pipeline.scheduler`), gradient
clipping (:mod:`~pipedream_ft.pipeline.stepper`), mixed precision (:mod:`~pipedream_ft.pipeline.precision`),
evaluation (:mod:`~pipedream_ft.pipeline.evaluate`) and the final model (:mod:`~pipedream_ft.pipeline.export`).
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import hashlib
import json
import logging
import sys
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from partitioner.balance import virtual_placement
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
from .pipeline.colocated import Handoff, StageConnection, StageRoute
from .pipeline.comm import Messenger, PeerTimeoutError
from .pipeline.connection import Connection, backend_and_device
from .pipeline.data import CallableFeed, DataComponent, StreamFeed, target_links, training_feed
from .pipeline.evaluate import EvalResult, MetricFn, evaluate_stages
from .pipeline.executor import DataFn, Executor, RankStats, agree_preflight
from .pipeline.export import pretrained_of, save_model, save_pretrained
from .pipeline.group import CommGroup
from .pipeline.hooks import HookList, Hooks
from .pipeline.modes import MODES, Mode, make_mode
from .pipeline.precision import LossScale, LossScaler, autocast_context
from .pipeline.record import TrainRecord
from .schedules.actions import COMMUNICATION, Action, Kind
from .pipeline.scheduler import SchedulerFactory, attach_scheduler
from .pipeline.materialize import Init, has_meta, materialize_stage
from .pipeline.memory_report import ActivationMeter, MemoryReport, memory_report, resident_bytes
from .pipeline.stage import build_stage, executed_layers, model_layers
from .pipeline.state import StageState
from .pipeline.stepper import Stepper
from .pipeline.tied import TiedParameters, find_tied, tie_declared
from .pipeline.topology import Topology
from .schedules.window import WindowSchedule, resolve_schedule
from .virtual import (iter_process_actions, merged_stats, process_actions, runs_virtual, stage_links, stage_plan,
                      stages_per_process, virtual_layout)

__all__ = ["MODES", "EvalResult", "LossScale", "PipelineConfig", "RankStats", "TrainResult", "PipelineTrainer",
           "release_all"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Stage:
    """One stage this process runs: its place, weights, update and executor, and the hooks that are its own."""

    topo: Topology
    state: StageState
    stepper: Stepper
    executor: Executor
    connection: Connection | StageConnection
    data_state: DataComponent
    meter: ActivationMeter
    record: TrainRecord
    scaler: LossScaler | None
    scheduler: Any
    own: HookList
    """The hooks of this stage alone (its trace, its metrics, its activation meter)."""
    feed: CallableFeed | StreamFeed | None = None

    @property
    def index(self) -> int:
        return self.topo.stage


class _StateDicts:
    """The union of several stage modules' ``state_dict()`` (original keys): what export writes for a process."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = modules

    def state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for m in self.modules:
            out.update(m.state_dict())
        return out


class PipelineTrainer:
    """Runs this process's stage of ``plan`` — or its stages, under a schedule that gives a process several.

    ``model`` is the whole model (an ``nn.Sequential`` or an fx-traceable module) or a zero-argument factory
    for it; only this process's layers are kept. ``optimizer_factory(params)`` builds a stage's optimizer (it is
    not called for a stage without parameters); ``scheduler_factory(optimizer)``, if given, builds its LR
    scheduler, stepped after every update. ``profile`` (the model's profile) lets a job whose world size
    changed re-plan; with checkpointing it is also stored beside the checkpoints, so later attempts can re-plan
    without it. A parameter used by layers of several stages (tied embeddings) is kept equal on all of them
    (see :mod:`pipedream_ft.pipeline.tied`); ``tied_parameters`` also ties groups of distinct parameters by
    name (e.g. ``[["wte.weight", "lm_head.weight"]]``). A model built on the ``meta`` device (under
    ``torch.device("meta")``) costs nothing to build: only this process's stages get storage, with values from
    ``init`` (see :mod:`pipedream_ft.pipeline.materialize`: by default the model's own initialisation seeded per
    module from ``config.seed``; ``FromFile(path)`` reads only the stage's tensors from a weights file); ``init``
    given with a real model re-initialises the stage the same way. The trainer builds its own process groups (it
    does not need ``torch.distributed``'s default group); :meth:`close` releases them.

    Under a schedule that gives a process several stages (interleaved 1F1B, ZBV, DualPipeV, a table of several
    stages per rank: see :mod:`pipedream_ft.virtual`) the process still is one rank of the job, on one thread:
    :attr:`stages` holds one stage each, and the views of one stage (:attr:`topo`, :attr:`state`,
    :attr:`executor`, :attr:`module`, ...) are its first stage's.
    """

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
        init: Init | None = None,
    ) -> None:
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
        storage = Storage(checkpoint.url, checkpoint.storage_options) \
            if checkpoint is not None and checkpoint.url is not None else None
        schedule = planned_schedule(config.schedule, plan.settings)
        resolved = resolve_schedule(schedule)
        self.layout: WindowSchedule | None = None
        """The schedule of several stages per process (``None``: one stage per process)."""
        if runs_virtual(resolved):
            plan = self._virtual_plan(plan, resolved, storage, model_hash, len(ml.names))
            assert self.layout is not None
            self.mode: Mode = make_mode(config.mode, config.flush_every, config.update_every, self.layout)
            by_stage = stage_plan(plan)
            indices = self.layout.stages_of(env.rank)
        else:
            self.mode = make_mode(config.mode, config.flush_every, config.update_every, schedule)
            if plan.world_size != env.world_size and len(ml.names) == plan.num_layers:
                plan = replan_for_world(plan, self.profile, env.world_size, rank=env.rank, storage=storage)
            elif storage is not None:
                plan = self._replanned(plan, storage)
            plan.check_fits(profile_hash=model_hash, num_layers=len(ml.names), world_size=env.world_size)
            by_stage = plan
            indices = [plan.stage_of_rank(env.rank).index]
        self.plan = plan
        self.stage_indices: list[int] = indices
        """The stages this process runs, in order."""
        topos = [Topology.of(by_stage, s) for s in indices] if self.layout is not None \
            else [Topology.of(plan, env.rank)]
        for t in topos:
            self.mode.check(t)
        single = self.layout is None
        self.connection = Connection(
            rank=env.rank, world_size=env.world_size, backend=self.backend, device=self.device,
            timeout_s=config.timeout_s, replica_ranks=topos[0].stage_ranks if single else None, links=self._links)
        """This process's one communication handle: every component talks through it (each stage of several
        through its own view of it); each epoch re-configures it."""
        self.handoff = Handoff()
        """What the stages of this process hand each other (several stages only)."""
        self.facts = {"plan": plan_fact(plan), "model": model_fact(ml.names, ml.root),
                      "mode": mode_fact({"mode": repr(self.mode), "update_every": config.update_every,
                                         "clip_grad_norm": config.clip_grad_norm, "autocast": config.autocast_dtype,
                                         "compensation": config.compensation}),
                      "data": data_fact(seed=config.seed, checkpoint_url=checkpoint.url if checkpoint else None)}
        """What every process must hold the same of, checked at start-up (see :mod:`pipedream_ft.ft.agreement`)."""
        del ml
        self.in_place = env.recovery == "in-place"
        if self.in_place and checkpoint is None:
            checkpoint = CheckpointConfig()  # in-place recovery needs the memory tier at least
        if storage is not None:
            refuse_per_process(storage)
        # every check above is local and the same on every process; only now talk to the others
        self.coordinator = Coordinator(env, config.timeout_s)
        self.faults = FaultInjector.from_env(rank=env.rank, attempt=env.restart_count,
                                             connect=lambda: store_connection(env, config.timeout_s),
                                             key_prefix=f"pipedream-ft/{env.run_id}/faults")
        self.hooks = HookList()
        """The process's hooks; with one stage, its own hooks too (every hook of the process, in one list)."""
        self._front: list[Hooks] = []
        """The process's hooks that come before a stage's own (fault injection, watchdog)."""
        self._back: list[Hooks] = []
        """The process's hooks that come after (progress, milestones)."""
        if self.faults:
            self._front.append(self.faults)
        if config.watchdog_s:
            self._front.append(WatchdogHook(Watchdog(config.watchdog_s, rank=env.rank,
                                                     health_file=config.health_file), indices[0]))
        reporter = self.plan.num_stages - 1 in indices and topos[-1].replica == 0
        self.progress = ProgressHook(bar=config.progress and env.rank == 0,
                                     report=self.coordinator.report_progress if reporter else None,
                                     last_loss=self._last_loss, reported_loss=self.coordinator.last_loss)
        self._back += [self.progress, _Milestones(self.timeline, lambda: self.recoveries)]
        self._totals: dict[int, torch.Tensor] = {}
        """A window's reduced norms and overflow flags, per stage, until its update takes them (several stages)."""
        copies = [model] + [copy.deepcopy(model) for _ in indices[1:]]  # each stage keeps its own layers
        del model
        self.stages: list[_Stage] = []
        """This process's stages, in order."""
        for k, topo in enumerate(topos):
            self.stages.append(self._build_stage(copies[k], by_stage, topo, k, loss_fn, optimizer_factory,
                                                 extra_state, scheduler_factory, init))
            copies[k] = None  # type: ignore[call-overload]
        del copies
        first = self.stages[0]
        self.topo = first.topo
        """The first stage's place (the only one's, with one stage per process)."""
        self.state = first.state
        self.executor = first.executor
        self.stepper = first.stepper
        self.scaler = first.scaler
        self.scheduler: Any = first.scheduler
        """The first stage's LR scheduler (``None`` without ``scheduler_factory`` or parameters)."""
        self.data_state = first.data_state
        self.record = first.record
        self._meter = first.meter
        self._every = self.hooks
        """Every hook of the process, each once: the process's and every stage's own."""
        if single:
            self.hooks = self._every = first.executor.hooks  # one list: the stage's hooks are the process's
        else:
            for h in (*self._front, *self._back):
                self.hooks.add(h)
            self._every = HookList([*self._front, *(h for st in self.stages for h in st.own.hooks), *self._back])
        self.ckpt: Checkpointer | None = None
        if checkpoint is not None:
            self.ckpt = Checkpointer(checkpoint, parts=[(st.topo, st.state) for st in self.stages], mode=self.mode,
                                     coordinator=self.coordinator, hooks=self.hooks, connection=self.connection,
                                     profile=profile, job=self.coordinator.job_id(),
                                     faults=self.faults if self.faults.checkpoint_faults else None,
                                     flush=self._flush_sends,
                                     part_hooks=None if single else [st.own for st in self.stages])
            for k, st in enumerate(self.stages):
                ex = st.executor
                ex.on_cut = (lambda cut, flags, k=k: self._on_cut(cut, flags, k))
                if st.topo.is_first:
                    ex.decide = self.ckpt.decide
        if config.replan is not None:
            self._start_replanning(config.replan)
        self.fingerprint = hashlib.sha256(json.dumps(
            [plan_hash(plan, self.mode), plan.profile_hash, checkpoint.url if checkpoint else None]).encode()).hexdigest()
        self.inplace: InPlace | None = None
        """This process's part in in-place recovery (see :mod:`pipedream_ft.ft.inplace`); ``None`` without it."""
        if self.in_place:
            self.inplace = InPlace(env, coordinator=self.coordinator, checkpointer=self.ckpt, faults=self.faults,
                                   hooks=self._every, fingerprint=self.fingerprint, timeout_s=config.timeout_s,
                                   recovery_timeout_s=config.recovery_timeout_s, hang_s=config.hang_s)
        self._side = _PipelineSide(self)
        self.redone = 0
        self.resumed_from = self._start()
        self.timeline["restored"] = time.time()
        self._each_hooks(lambda h: h.on_event("start", attempt=env.restart_count, resumed_from=self.resumed_from))
        if self.resumed_from is not None:
            self._log_resume()
        _OPEN.add(self)

    # -- set-up ---------------------------------------------------------------------------------------------

    def _virtual_plan(self, plan: Plan, schedule: str | WindowSchedule, storage: Storage | None,
                      model_hash: str | None, num_layers: int) -> Plan:
        """The plan of a schedule of several stages per process: ``W v`` stages for ``W`` processes (planned again
        from the profile, or the one stored with the checkpoints, when the plan has another count; or the stored
        re-plan from measured costs), laid out as the schedule places them (:attr:`layout`)."""
        env, config = self.env, self.config
        stages = env.world_size * stages_per_process(schedule, plan, env.world_size)
        if plan.num_stages != stages and isinstance(schedule, str) and (self.profile is not None or
                                                                      storage is not None):
            # the job runs on another number of processes than the plan was made for: plan as many stages again
            where = virtual_placement(schedule, env.world_size, stages // env.world_size)  # balanced across them
            plan = replan_for_world(plan, self.profile, stages, rank=env.rank, storage=storage, processes=where)
        elif storage is not None:
            layout = virtual_layout(schedule, plan, env.world_size, config.flush_every)
            plan = self._replanned(plan, storage, make_mode(config.mode, config.flush_every, config.update_every,
                                                            layout))
        layout = virtual_layout(schedule, plan, env.world_size, config.flush_every)
        assert layout is not None
        stage_plan(plan).check_fits(profile_hash=model_hash, num_layers=num_layers, world_size=plan.num_stages)
        self.layout = layout
        return plan

    def _replanned(self, plan: Plan, storage: Storage, mode: Mode | None = None) -> Plan:
        """The plan the job re-planned ``plan`` into from measured costs, if it did (see :mod:`pipedream_ft.ft.replan`)."""
        mode = mode if mode is not None else self.mode
        replanned = load_replanned(storage, plan, lambda p: plan_hash(p, mode))
        if replanned is not plan and self.env.rank == 0:
            say(f"pipedream-ft: the job re-planned {describe_plan(plan)} into {describe_plan(replanned)}; "
                "continuing on it", sys.stdout)
        return replanned

    def _build_stage(self, model: nn.Module, plan: Plan, topo: Topology, k: int,
                     loss_fn: Callable[[Any, Any], torch.Tensor],
                     optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                     extra_state: dict[str, Any] | None, scheduler_factory: SchedulerFactory | None,
                     init: Init | None) -> _Stage:
        """This process's ``k``-th stage (``topo``'s) from its own copy ``model`` of the model."""
        config, env = self.config, self.env
        several = self.layout is not None
        s = topo.stage
        ml = model_layers(model)
        module = build_stage(ml, plan, s)
        if init is not None or has_meta(model):  # only this stage's tensors get storage (and values)
            materialize_stage(model, [module], init=init, seed=config.seed, also=[ml.root])
        module = module.to(self.device)
        connection: Connection | StageConnection = self.connection
        if several:
            assert self.layout is not None
            connection = StageConnection(self.connection, StageRoute(s, tuple(self.layout.placement)), self.handoff)
        specs = find_tied(ml, executed_layers(ml, plan.layer_to_stage, plan.num_stages, plan.recompute))
        self.tied_specs = specs
        tied = None
        if any(s in spec.stages for spec in specs):
            objects = dict(ml.root.named_parameters(remove_duplicate=False))
            tied = TiedParameters(specs, objects, module, topo, self.mode, optimizer_factory,
                                  connection=connection)  # type: ignore[arg-type]
            tied.defer = several  # a holder on this process may give its gradient later in the window's updates
        state = StageState(module, optimizer_factory, stage=s, replica=topo.replica,
                           keep=self.mode.versions_kept(topo), extra=extra_state, tied=tied)
        meter = ActivationMeter(lambda: self._weight_tensors(state))
        meter.attach(module)
        if tied is not None and scheduler_factory is not None:
            tied.attach_schedulers(scheduler_factory)
        scheduler = attach_scheduler(state, scheduler_factory, optimizer_factory)
        scaler = LossScaler(config.loss_scale) if config.autocast_dtype == torch.float16 else None
        if scaler is not None:
            state.components["loss_scale"] = scaler
        data_state = DataComponent()
        if topo.is_first:
            state.components["data"] = data_state
        stepper = Stepper(state, topo=topo, synchronous=not self.mode.asynchronous,
                          connection=connection,  # type: ignore[arg-type]
                          clip_grad_norm=config.clip_grad_norm, scaler=scaler,
                          scheduler=scheduler, compensation=config.compensation,
                          delay=self.mode.delay(topo))
        own = HookList()
        if config.trace_dir:
            row = (env.rank, f"rank {env.rank} · stages {', '.join(map(str, self.stage_indices))}") if several else None
            own.add(TimelineHook(TimelineRecorder(config.trace_dir, rank=env.rank * len(self.stage_indices) + k
                                                  if several else env.rank, stage=s, replica=topo.replica,
                                                  attempt=env.restart_count, process=env.incarnation, row=row),
                                 topo.replica))
        executor_box: list[Executor] = []
        if config.metrics_dir:
            writer = MetricsWriter(config.metrics_dir, env.rank * len(self.stage_indices) + k if several else env.rank)
            own.add(MetricsHook(writer, rank=env.rank, stage=s, attempt=env.restart_count,
                                stats=lambda: executor_box[0].stats, last_loss=self._last_loss,
                                extra=self._metrics_extra))
        hooks = HookList()
        for h in self._front:
            hooks.add(h)
        for h in own.hooks:
            hooks.add(h)
        for h in self._back:
            hooks.add(h)
        hooks.add(meter)
        own.add(meter)
        step = stepper.step
        if several:
            totals = self._totals
            step = (lambda: stepper.step(totals.pop(s, None)))
        executor = Executor(topo, state, self.mode, connection=connection,  # type: ignore[arg-type]
                            device=self.device, loss_fn=loss_fn, seed=config.seed, hooks=hooks, step=step,
                            autocast=autocast_context(config.autocast_dtype, self.device),
                            loss_factor=(lambda: scaler.scale) if scaler is not None else None, stops=cuts.stops,
                            colocated=frozenset(self.stage_indices) - {s} if several else frozenset(),
                            handoff=self.handoff if several else None)
        executor.rank = env.rank
        executor_box.append(executor)
        record = TrainRecord(executor.losses.pairs)
        state.components["record"] = record  # a restored part brings its call's loss history back
        return _Stage(topo, state, stepper, executor, connection, data_state, meter, record, scaler,
                      scheduler.scheduler if scheduler is not None else None, own)

    def _links(self) -> list[tuple[int, str]]:
        """``(peer, link)`` of every message stream of this process (under NCCL, a communicator each)."""
        if self.layout is None:
            topo, tied = self.topo, self.state.tied
            return topo.links() + target_links(topo) + (tied.links() if tied else [])
        return stage_links(self.layout.placement, self.stage_indices, [spec.stages for spec in self.tied_specs])

    def _start(self) -> int | None:
        """Join the group and restore what there is to restore; returns the position resumed from (or None).

        A replacement process (in-place recovery) joins the running group's next epoch and restores the cut
        every process agrees on; any other process agrees on a fresh namespace with every process of its attempt
        and, with checkpointing, resumes from the newest checkpoint they can all restore."""
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
        """Measure each stage's costs (every process) and decide re-plans (rank 0); see
        :mod:`pipedream_ft.ft.replan_control`."""
        if self.ckpt is None or self.ckpt.storage is None:
            raise PipelineSetupError("re-planning needs a durable checkpoint tier (CheckpointConfig(url=...)): the "
                                     "new plan starts from a checkpoint resharded into it")
        if self.profile is None:
            self.profile = load_stored_profile(self.ckpt.storage)
        key = plan_hash(self.plan, self.mode)
        several = self.layout is not None
        for st in self.stages:
            slot = st.index if several else None
            measure = Measure(policy, (lambda ex=st.executor: ex.stats), st.index,
                              (lambda value, slot=slot: self.coordinator.publish_measurement(key, value, slot)))
            st.own.add(measure)
            st.executor.hooks.add(measure)
        if self.env.rank == 0:
            control = RePlanControl(policy, plan=self.plan, profile=self.profile, key=key,
                                    world_size=self.plan.num_stages if several else self.env.world_size,
                                    coordinator=self.coordinator, storage=self.ckpt.storage,
                                    slots=range(self.plan.num_stages) if several else None,
                                    placement=self.layout.placement if self.layout is not None else None)
            self.ckpt.replan_due = control.due

    def _connect(self, store: Any, cancelled: Callable[[], bool] | None = None) -> None:
        """Form this epoch's process groups in namespace ``store`` (see :class:`CommGroup` for ``cancelled``)."""
        self.connection.configure(store, cancelled)
        self.timeline["joined"] = time.time()
        log.info("rank %d/%d joined (%s, restart %d, process %d)", self.env.rank, self.env.world_size,
                 self.backend, self.env.restart_count, self.env.incarnation)

    def _release(self) -> None:
        """Let go of this epoch's groups and of every pending operation on them: their connections close, so
        every process still waiting on this one fails at once and joins the recovery too."""
        for st in self.stages:
            st.executor.abandon()
            if isinstance(st.connection, StageConnection):
                st.connection.forget()
        self.handoff.clear()
        self.connection.release()

    def _flush_sends(self) -> None:
        """Wait for every send of this process (each stage's, with several)."""
        if self.layout is None:
            self.connection.flush()
        else:
            for st in self.stages:
                st.connection.flush()

    def _on_cut(self, cut: int, flags: int, k: int) -> None:
        assert self.ckpt is not None
        self.ckpt.on_cut(cut, flags, k)

    @property
    def group(self) -> CommGroup:
        """The current epoch's process groups (:class:`NotConnectedError` between epochs)."""
        return self.connection.group

    @property
    def messenger(self) -> Messenger:
        """The current epoch's messenger of the (first) stage (:class:`NotConnectedError` between epochs)."""
        return self.stages[0].connection.messenger

    def _recover(self, failure: str) -> None:
        """A peer failed: recover in place (see :mod:`pipedream_ft.ft.inplace`), then count the work redone."""
        assert self.inplace is not None
        last = self.stages[-1].executor
        newest = last.losses.last_minibatch()
        reached = self.position if newest is None else newest
        formed, _ = self.inplace.recover(self._side, failure)
        if self.is_last:
            self.redone = max(0, reached + 1 - formed.cut)

    @property
    def membership(self) -> Membership | None:
        """This process's membership of the in-place recovery's epochs (``None`` without in-place recovery)."""
        return self.inplace.membership if self.inplace is not None else None

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """One record per in-place recovery this process took part in: wall-clock times of the failure, the
        group formed again, the state restored and the first update after it; the epoch and the cut."""
        return self.inplace.records if self.inplace is not None else []

    def _last_loss(self) -> float | None:
        return self.stages[-1].executor.losses.latest() if self.is_last else None

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

    def _each_hooks(self, call: Callable[[Hooks], None]) -> None:
        """Call every hook of the process once: its own, and each stage's (several stages)."""
        call(self._every)

    # -- views ----------------------------------------------------------------------------------------------

    @property
    def position(self) -> int:
        """Minibatches trained so far (the data position)."""
        return self.state.position

    @property
    def stage_index(self) -> int:
        """This process's (first) stage."""
        return self.topo.stage

    @property
    def replica(self) -> int:
        return self.topo.replica

    @property
    def is_first(self) -> bool:
        """Whether this process runs stage 0."""
        return self.stages[0].topo.is_first

    @property
    def is_last(self) -> bool:
        """Whether this process runs the last stage."""
        return self.stages[-1].topo.is_last

    @property
    def module(self) -> nn.Module:
        return self.state.module

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.state.optimizer

    @property
    def stats(self) -> RankStats:
        """Where this process's time went (over its stages, with several)."""
        if len(self.stages) == 1:
            return self.executor.stats
        return merged_stats([st.executor.stats for st in self.stages])

    # -- training -------------------------------------------------------------------------------------------

    def _feeds_for(self, data: Any, steps: int) -> None:
        for st in self.stages:
            st.feed = training_feed(data, st.feed, topo=st.topo, connection=st.connection,  # type: ignore[arg-type]
                                    component=st.data_state, position=self.position, steps=steps,
                                    checkpointing=self.ckpt is not None)

    @property
    def _feed(self) -> CallableFeed | StreamFeed | None:
        return self.stages[0].feed

    def preflight(self, data: DataFn | Any) -> None:
        """Check every stage on one minibatch before training (see :meth:`Executor.preflight`). A collective."""
        self._feeds_for(data, 0)
        self._preflight()

    def _preflight(self) -> None:
        for st in self.stages:  # first every stage's targets on their way (the last stage waits for them)
            assert st.feed is not None
            st.feed.prepare(self.position)
        agree_preflight(self.connection.group, [st.executor.preflight_check(st.feed)  # type: ignore[arg-type]
                                                for st in self.stages])
        for st in self.stages:
            st.executor.preflight_done = True

    def schedule(self, start: int, stop: int) -> list[Action]:
        """This process's compute and update actions for minibatches ``[start, stop)``, in order."""
        if self.layout is not None:
            return self.layout.rank_actions(self.env.rank, start, stop)
        return self.mode.schedule(self.topo, start, stop)

    def lowered(self, start: int, stop: int) -> list[Action]:
        """What this process runs for minibatches ``[start, stop)``: :meth:`schedule` with the sends and receives
        to and from the other processes, receives posted early."""
        if self.layout is not None:
            return process_actions(self.layout, self.env.rank, start, stop)
        return self.mode.lowered(self.topo, start, stop)

    def _lowering(self, start: int, stop: int) -> Iterator[Action]:
        """:meth:`lowered`, made as it runs (see :meth:`~pipedream_ft.pipeline.modes.Mode.iter_lowered`)."""
        if self.layout is not None:
            return iter_process_actions(self.layout, self.env.rank, start, stop)
        return self.mode.iter_lowered(self.topo, start, stop)

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
        self._feeds_for(data, steps)
        stop = self.position + steps
        t0 = time.perf_counter()
        began = self.position
        start = began
        for k, st in enumerate(self.stages):
            first, pairs = st.record.begin(began, stop)
            st.executor.losses.reset(pairs)
            if k == 0:
                start = first
        if steps:
            self._keep_start_cut()
        if self.ckpt is not None:
            self.ckpt.ending_at(stop if finish else None)
        self._each_hooks(lambda h: h.on_train_start(start, stop))
        mark_training()  # an error from now on is a crash, not a set-up error (see pipedream_ft.crashlog)
        try:
            while True:
                failure = self._run(stop)
                if failure is None:
                    self._each_hooks(lambda h: h.on_event("gathering"))
                    failure, losses = self._gather_losses()
                    trained = time.perf_counter()  # the result's time: training, not the checkpoints' commit
                if failure is None and finish:
                    self._each_hooks(lambda h: h.on_event("finishing"))
                    failure = self._finish_checkpoints(stop)
                if failure is None:
                    break
                self._recover(failure)
        except BaseException:
            if self.ckpt is not None:  # nothing is left to save: SIGTERM ends the process again
                self.ckpt.stand_down()
            raise
        finally:
            for st in self.stages:
                st.record.end()
            self._each_hooks(lambda h: h.on_train_end(start, stop))
        for st in self.stages:
            st.state.position = stop
        self.progress.report(stop, force=True)
        seconds = trained - t0
        result = TrainResult(losses, start, seconds, self.stats, trained=stop - began)
        if self.config.summary:
            self._print_summary(seconds)
        return result

    def _keep_start_cut(self) -> None:
        """With in-place recovery, make the position training starts from a cut of the memory tier (unless this
        process's parts of it are there already), and wait until it is stored: so there is always a cut that
        every process can restore, even when one fails before the policy's first one (a replacement could rebuild
        the initial state, but the survivors no longer have it)."""
        ckpt = self.ckpt
        if self.membership is None or ckpt is None or ckpt.memory is None or ckpt.memory_tier is None:
            return
        if any(self.position not in ckpt.memory_tier.steps([name]) for name in ckpt.names):
            for k in range(len(self.stages)):
                ckpt.on_cut(self.position, 0, k)
        ckpt.flush_memory(timeout=ckpt.config.commit_timeout_s)

    def _run(self, stop: int) -> str | None:
        """Run this process's lowered list from the current position to ``stop``. Returns ``None`` when done, or
        — with in-place recovery — why the group failed (the exception and its frames, which hold pending
        operations, are gone by the time the caller recovers)."""
        try:
            if not all(st.executor.preflight_done for st in self.stages):
                self._preflight()
            actions = self._lowering(self.position, stop)
            if self.layout is None:
                self._run_one(actions)
            else:
                self._run_several(actions)
            for st in self.stages:
                if st.state.tied:
                    st.state.tied.drain(stop // self.mode.update_unit(st.topo))
            self._each_hooks(lambda h: h.on_event("draining"))
            self._flush_sends()
            if len(self.handoff):
                raise PipelineSetupError(f"process {self.env.rank}: {len(self.handoff)} value(s) handed between its "
                                         "stages were never taken: the lowered schedule is out of order")
            self.faults.at_drained()
            return None
        except PipelineSetupError as exc:  # found here; any recovery would meet it again: the whole group stops
            if exc.agreed:  # every process holds this same line already (the pre-flight's check is a collective)
                raise
            self.coordinator.publish_job_error(str(exc))
            error = self.coordinator.job_error()  # as every process reads it (the first published), the same line
            if error is not None:
                raise JobError(error) from exc
            raise
        except PeerTimeoutError as exc:
            return self._peer_failure(exc)

    def _run_one(self, actions: Iterable[Action]) -> None:
        """One stage: every action to its executor, in order."""
        ex, hooks, ckpt, feed = self.executor, self.hooks, self.ckpt, self.stages[0].feed
        for action in actions:
            hooks.on_action(action)
            ex.run(action, feed)  # type: ignore[arg-type]
            if ckpt is not None:
                ckpt.announce_preemption()

    def _run_several(self, actions: Iterable[Action]) -> None:
        """Several stages: each action to its stage's executor, in order; a window's updates together (see
        :meth:`_updates`)."""
        by_stage = {st.index: st for st in self.stages}
        ckpt = self.ckpt
        update, communication = Kind.U, COMMUNICATION
        it = iter(actions)
        action = next(it, None)
        while action is not None:
            if action.kind is update:  # the window's updates, with the sends and receives among them
                group = [action]
                action = next(it, None)
                while action is not None and (action.kind is update or action.kind in communication):
                    group.append(action)
                    action = next(it, None)
                self._updates(group, by_stage)
                continue
            st = by_stage[action.stage]
            st.executor.hooks.on_action(action)
            st.executor.run(action, st.feed)  # type: ignore[arg-type]
            if ckpt is not None:
                ckpt.announce_preemption()
            action = next(it, None)

    def _updates(self, group: list[Action], by_stage: dict[int, _Stage]) -> None:
        """Run a window's updates — with the sends and receives among them, in the list's order — together: one
        all-reduce of every stage's gradient norms and overflow flags first (when clipping or scaling), and each
        tied update once every holder on this process has given its gradient."""
        updates = [a for a in group if a.kind is Kind.U]
        if len({a.index for a in updates}) != 1 or sorted(a.stage for a in updates) != self.stage_indices:
            raise PipelineSetupError(f"process {self.env.rank} updates {', '.join(map(str, updates))} together: a "
                                     f"window's updates must come together, one for each of stages "
                                     f"{self.stage_indices}")
        stages = [by_stage[a.stage] for a in updates]
        if stages[0].stepper.agrees:
            flat = sum(st.stepper.terms() for st in stages)
            assert isinstance(flat, torch.Tensor)
            self.connection.messenger.wait(self.connection.group.control.allreduce([flat]),
                                           "all-reduce of gradient norms and overflow flags over every stage")
            for st in stages:
                self._totals[st.index] = flat
        try:
            for a in group:
                st = by_stage[a.stage]
                st.executor.hooks.on_action(a)
                st.executor.run(a, st.feed)  # type: ignore[arg-type]
        finally:
            self._totals.clear()
        for a, st in zip(updates, stages):
            if st.state.tied:
                st.state.tied.drain(a.index + 1)
        if self.ckpt is not None:
            self.ckpt.announce_preemption()

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
        """Every minibatch's loss of the call, on every process; or — with in-place recovery — why the group
        failed while gathering them. The gather is the last collective of the recoverable region: a peer that
        dies while the others wait here (they finished their last minibatch, it had not) is recovered like one
        that dies while they train, instead of failing the processes that were done."""
        try:
            mine = self.stages[-1].executor.losses.pairs() if self.is_last else []
            merged = sorted(x for part in self.connection.group.all_gather_object(mine) if part for x in part)
            return None, [loss for _, loss in merged]
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
        """Gather every stage's statistics and print a table on rank 0. A collective."""
        rows = self.group.all_gather_object([{**self._stats_row(st), "seconds": seconds} for st in self.stages])
        if self.env.rank == 0:
            print(summary_table([r for part in rows for r in part]), flush=True)

    def fit(self, data: DataFn | Any, total: int) -> TrainResult:
        """Train until ``total`` minibatches are done in all, continuing from a resumed checkpoint's position;
        then wait for pending checkpoints to commit. A collective."""
        result = self._train(data, max(0, total - self.position), finish=self.ckpt is not None)
        if self.ckpt is not None and self.env.local_rank == 0:  # everybody on this node is done with the memory tier
            self.ckpt.discard_memory()
        return result

    # -- results --------------------------------------------------------------------------------------------

    def gather_stats(self) -> list[dict[str, Any]]:
        """Every stage's :class:`RankStats` of the last :meth:`train` (as dicts, with its process's rank and its
        stage, and under ``"memory"`` its process's :meth:`memory_report` as a dict), in rank then stage order,
        on every process. A collective."""
        memory = self.memory_report().as_dict()
        rows = self.group.all_gather_object([{**self._stats_row(st), "memory": memory} for st in self.stages])
        return [r for part in rows for r in part]

    @staticmethod
    def _weight_tensors(state: StageState) -> list[torch.Tensor]:
        """The weight versions a stage keeps (what a forward reads as weights besides its parameters)."""
        versions = state.versions
        tied = state.tied
        kept = [versions.current, *versions.history.values()]
        if tied:
            kept += [v for g in tied.groups for v in (g.versions.current, *g.versions.history.values())]
        return [t for v in kept for t in v.tensors]

    def memory_report(self) -> MemoryReport:
        """This process's memory: its stages' weights, gradients, optimizer state, weight versions and in-flight
        activations against its peak and the plan's prediction (see :mod:`pipedream_ft.pipeline.memory_report`)."""
        predicted = None
        if self.profile is not None:
            from partitioner.cost import stage_memory

            predicted = 0.0
            for st in self.stages:
                layers = [self.profile.layers[i] for i in self.plan.stages[st.index].layers]
                predicted += float(stage_memory(sum(layer.parameter_bytes for layer in layers),
                                                sum(layer.activation_bytes for layer in layers),
                                                self.plan.num_stages - st.index))
        tied = [g for st in self.stages if st.state.tied for g in st.state.tied.groups]
        module = self.state.module if len(self.stages) == 1 else nn.ModuleList([st.state.module for st in self.stages])
        return memory_report(stage=self.topo.stage, module=module,
                             optimizers=[*(st.state.optimizer for st in self.stages), *(g.optimizer for g in tied)],
                             trainable=[p for st in self.stages for p in st.state.all_live_params],
                             stash_bytes=self.stats.peak_stash_bytes, meter=self._meter, device=self.device,
                             baseline=self._baseline, predicted=predicted,
                             limit=self.plan.settings.get("memory_bytes"))

    def _stats_row(self, st: _Stage) -> dict[str, Any]:
        return {"rank": self.env.rank, "stage": st.index, **st.executor.stats.as_dict()}

    def _modules(self) -> Any:
        """What this process writes of the model: its (first) replica's stage modules."""
        if len(self.stages) == 1:
            return self.state.module
        return _StateDicts([st.state.module for st in self.stages])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights (original keys), gathered from the stages onto every process. A collective."""
        mine = {k: v.detach().cpu() for k, v in self._modules().state_dict().items()} if self.topo.replica == 0 \
            else {}
        out: dict[str, torch.Tensor] = {}
        for part in self.group.all_gather_object(mine):
            out.update(part or {})
        return out

    def evaluate(self, data: DataFn | Any, steps: int, metric_fn: MetricFn | None = None) -> EvalResult:
        """Mean loss (and ``metric_fn(outputs, targets)`` per minibatch) of minibatches ``0 .. steps - 1`` of
        ``data``, forward only, in eval mode, with the current weights, changing nothing (see
        :mod:`pipedream_ft.pipeline.evaluate`); between :meth:`train` calls. A collective."""
        feed = self._feed
        return evaluate_stages([st.executor for st in self.stages], data, steps, metric_fn,
                               training_source=feed.source if feed is not None else None)

    def save_model(self, path: str, format: str = "torch") -> None:
        """Write the whole model's weights to ``path`` as ``"safetensors"`` (each stage writes its own tensors into
        the one file; no process holds more than its stages) or ``"torch"`` (``torch.save``, gathered onto rank
        0); the plain model's ``load_state_dict(strict=True)`` accepts the file (see
        :mod:`pipedream_ft.pipeline.export`). A collective."""
        save_model(self.messenger, self._modules(), replica=self.topo.replica, path=path, format=format,
                   stage=self.topo.stage)

    def save_pretrained(self, directory: str, max_shard_bytes: int = 5 * 10**9) -> None:
        """Write the whole model as a Hugging Face directory (config and safetensors shards, each stage writing its
        own) that ``AutoModelForCausalLM.from_pretrained(directory)`` loads with no missing or unexpected keys (see
        :func:`pipedream_ft.pipeline.export.save_pretrained`); for transformers models. A collective."""
        save_pretrained(self.messenger, self._modules(), replica=self.topo.replica, directory=directory,
                        pretrained=self._pretrained, max_shard_bytes=max_shard_bytes, stage=self.topo.stage)

    def close(self) -> None:
        """Wait for pending checkpoint commits, stop the background threads, close the traces, and shut this
        process's groups down (no backend thread outlives it). Idempotent."""
        try:
            if self.ckpt is not None:
                self.ckpt.close()  # raises if the last durable cut could not be committed
        finally:
            self._each_hooks(lambda h: h.close())
            if self.inplace is not None:
                self.inplace.close()
            self.release()

    def release(self) -> None:
        """Shut this process's groups down now (idempotent; also done at interpreter exit)."""
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

    def restore(self, parts: Sequence[dict[str, Any]]) -> None:
        for st, part in zip(self.t.stages, parts, strict=True):
            st.state.restore(part)

    def rewind(self, cut: int) -> None:
        for st in self.t.stages:
            st.executor.rewind(cut)
            feed = st.feed
            if isinstance(feed, StreamFeed):  # stage 0 reads the source again from the restored state
                feed.rewind()
                if st.topo.is_first:
                    st.data_state.attach(feed, self.t.position)


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
