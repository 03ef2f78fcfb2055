"""Virtual stages: one process runs several stages of the plan (interleaved 1F1B, ZBV, DualPipeV) on its one rank.

``PipelineTrainer(model, plan, config=PipelineConfig(mode="flush", schedule="interleaved_1f1b"))`` on ``W``
processes, with a plan of ``S = v W`` stages, gives each process ``v`` stages (where the schedule places them:
stage ``s`` on rank ``s % W`` for the looped schedules; ``r`` and ``2W - 1 - r`` for the V schedules). It returns
a :class:`VirtualTrainer`, the facade of this module, with the trainer's methods.

A process is one rank of ``W`` (one set of process groups, one store connection, one thread that trains) and
holds one executor per stage. It runs the *process's* lowered action list: the schedule's ``rank_actions`` with
the sends and receives :func:`~pipedream_ft.schedules.add_communication` adds between processes, receives moved
early (:func:`~pipedream_ft.schedules.comms.post_receives_early`); each action goes to its stage's executor, in
that order and no other. Two neighbouring stages of one process exchange nothing: the activation and its
gradient are handed over in memory (:mod:`~pipedream_ft.pipeline.colocated`). So nothing asks NCCL to put two
ranks on one GPU, and the V schedules run under NCCL too.

A window's updates are run together, as the schedule places them (every stage of a process updates at the end
of the window): the all-reduce of gradient norms and overflow flags (clipping, float16 loss scaling) is one for
the process, and tied weights whose holders share the process (the V schedules put the first and the last stage
together) apply their update once every holder has given its gradient.

Fault tolerance (checkpoints, in-place recovery, re-planning from measured costs) does not run per process yet:
a job that asks for it under these schedules runs each stage on a thread of its own, as a logical rank
(:mod:`pipedream_ft.virtual_threads`).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from partitioner.plan import Plan, PlanError
from profiler.profile import Profile

from .config import PipelineConfig, TrainResult, planned_schedule
from .env import DistEnv, read_env
from .errors import InvalidArgument, JobError, PipelineSetupError, mark_training
from .ft.agreement import agree, data_fact, mode_fact, model_fact, plan_fact
from .ft.coordination import Coordinator
from .ft.elastic import replan_for_world
from .ft.watchdog import Watchdog, WatchdogHook
from .observe.hooks import MetricsHook, ProgressHook, TimelineHook
from .observe.metrics import MetricsWriter, summary_table
from .observe.timeline import TimelineRecorder
from .pipeline.colocated import Handoff, StageConnection, StageRoute
from .pipeline.connection import Connection, backend_and_device
from .pipeline.data import CallableFeed, DataComponent, StreamFeed, training_feed
from .pipeline.evaluate import EvalResult, MetricFn, evaluate_stages
from .pipeline.executor import Executor, RankStats, agree_preflight
from .pipeline.export import pretrained_of, save_model, save_pretrained
from .pipeline.group import PeerTimeoutError
from .pipeline.hooks import HookList, Hooks
from .pipeline.materialize import Init, has_meta, materialize_stage
from .pipeline.memory_report import ActivationMeter, MemoryReport, memory_report, resident_bytes
from .pipeline.modes import Mode, make_mode
from .pipeline.precision import LossScaler, autocast_context
from .pipeline.scheduler import SchedulerFactory, attach_scheduler
from .pipeline.stage import build_stage, executed_layers, model_layers
from .pipeline.state import StageState
from .pipeline.stepper import Stepper
from .pipeline.tied import TiedParameters, find_tied, tie_declared
from .pipeline.topology import Topology
from .schedules.actions import COMMUNICATION, Action, Kind
from .schedules.comms import add_communication, post_receives_early
from .schedules.window import VIRTUAL, WindowSchedule, resolve_schedule, virtual_schedule

__all__ = ["VirtualTrainer", "merged_stats", "process_actions", "runs_virtual", "stage_links", "stage_plan",
           "stages_per_process", "virtual_layout"]

_V_SHAPED = ("zbv", "dualpipev")


def runs_virtual(schedule: Any) -> bool:
    """Whether ``schedule`` (a config's, ``"plan"`` resolved) gives a process several stages."""
    return (isinstance(schedule, str) and schedule in VIRTUAL) or (isinstance(schedule, WindowSchedule)
                                                                   and schedule.virtual)


def stages_per_process(schedule: str | WindowSchedule, plan: Plan, world_size: int) -> int:
    """How many stages each of ``world_size`` processes runs under ``schedule``: 2 for the V schedules, a table's
    own; for the looped ones the plan's share when it divides evenly, else what ``pipedream-partition`` planned it
    for (``settings["schedule"]["stages_per_worker"]``), else 2."""
    if isinstance(schedule, WindowSchedule):
        return schedule.num_stages // schedule.num_ranks
    if schedule in _V_SHAPED:
        return 2
    if plan.num_stages % world_size == 0 and plan.num_stages >= 2 * world_size:
        return plan.num_stages // world_size
    record = plan.settings.get("schedule")
    planned = record.get("stages_per_worker") if isinstance(record, dict) else None
    return planned if isinstance(planned, int) and planned >= 2 else 2


def virtual_layout(schedule: Any, plan: Plan, world_size: int, flush_every: int) -> WindowSchedule | None:
    """The schedule of several stages per process that ``schedule`` (a config's, ``"plan"`` resolved) gives
    ``plan`` on ``world_size`` processes; ``None`` for a schedule of one stage per process. Raises
    :class:`PlanError` when the plan's stages cannot be laid out that way."""
    if isinstance(schedule, str) and schedule in VIRTUAL:
        stages = plan.num_stages
        if schedule in _V_SHAPED:
            if stages != 2 * world_size:
                raise PlanError(f"schedule {schedule!r} runs 2 stages per process in a V: the plan has {stages} "
                                f"stages for {world_size} processes (plan {2 * world_size})")
            per_rank = None
        else:
            if stages % world_size or stages // world_size < 2:
                raise PlanError(f"schedule {schedule!r} runs v >= 2 stages per process: the plan has {stages} "
                                f"stages for {world_size} processes (plan a multiple of {world_size}, at least "
                                f"{2 * world_size})")
            per_rank = stages // world_size
        try:
            return virtual_schedule(schedule, world_size, flush_every, per_rank)
        except ValueError as exc:
            raise PlanError(f"schedule {schedule!r} on {world_size} processes: {exc}") from None
    if isinstance(schedule, WindowSchedule) and schedule.virtual:
        if schedule.num_ranks != world_size or schedule.num_stages != plan.num_stages:
            raise PlanError(f"the schedule {schedule} runs {schedule.num_stages} stages on {schedule.num_ranks} "
                            f"ranks; the plan has {plan.num_stages} stages and the job {world_size} processes")
        return schedule
    return None


def stage_plan(plan: Plan) -> Plan:
    """``plan`` with stage ``s`` on "rank" ``s``: the stages' own numbering, which a stage's messenger maps to the
    processes that hold them (:class:`~pipedream_ft.pipeline.colocated.StageRoute`). Refuses replicated stages."""
    replicated = [s.index for s in plan.stages if s.replicas != 1]
    if replicated:
        raise PlanError(f"virtual stages run a straight pipeline; the plan replicates stages {replicated}")
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, ranks=(s.index,)) for s in plan.stages))


def process_actions(layout: WindowSchedule, rank: int, start: int, stop: int) -> list[Action]:
    """What process ``rank`` runs for minibatches ``[start, stop)``: its stages' actions in the schedule's order,
    with the sends and receives between processes (none between its own stages), receives posted early."""
    every = {r: layout.rank_actions(r, start, stop) for r in range(layout.num_ranks)}
    lowered = add_communication(every, dict(enumerate(layout.placement)))
    return post_receives_early({rank: lowered[rank]})[rank]


def stage_links(placement: Sequence[int], mine: Sequence[int], tied: Sequence[Sequence[int]] = ()
                ) -> list[tuple[int, str]]:
    """``(peer rank, link)`` of every message stream between stages ``mine`` (of the process that holds them) and
    the stages of other processes, stage ``s`` running on rank ``placement[s]``: activations and gradients
    between neighbours, targets from the first stage to the last, tied gradients between the holders of each
    group of ``tied`` stages. A link is named by its channel and the stage that sends on it (``"act:2"``,
    ``"grad:3"``, see :class:`~pipedream_ft.pipeline.comm.Messenger`); under NCCL each gets a communicator of its
    own. Both ends of a stream list it."""
    last = len(placement) - 1
    here = set(mine)
    out: set[tuple[int, str]] = set()
    for s in here:
        for n, act, grad in ((s + 1, s, s + 1), (s - 1, s - 1, s)):
            if 0 <= n <= last and n not in here:
                out |= {(placement[n], f"act:{act}"), (placement[n], f"grad:{grad}")}
    if (0 in here) != (last in here):
        out.add((placement[last] if 0 in here else placement[0], "tgt:0"))
    for holders in tied:
        for s in set(holders) & here:
            for p in set(holders) - here:
                out |= {(placement[p], f"tied:{s}"), (placement[p], f"tied:{p}")}
    return sorted(out)


def merged_stats(parts: Sequence[RankStats]) -> RankStats:
    """A process's time over its stages: the times add up, the stash peaks too (each stage holds its own)."""
    out = RankStats()
    for p in parts:
        out.forward_s += p.forward_s
        out.backward_s += p.backward_s
        out.update_s += p.update_s
        out.wait_s += p.wait_s
        out.peak_stash_versions += p.peak_stash_versions
        out.peak_stash_bytes += p.peak_stash_bytes
    out.minibatches = parts[0].minibatches if parts else 0
    return out


@dataclasses.dataclass(eq=False)
class _Stage:
    """One stage of this process: its place, weights, update and executor, and the hooks that are its own."""

    topo: Topology
    state: StageState
    stepper: Stepper
    executor: Executor
    connection: StageConnection
    data_state: DataComponent
    meter: ActivationMeter
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


class VirtualTrainer:
    """This process's stages of a plan of virtual stages, on its one rank and one thread (see the module
    docstring); made by :class:`~pipedream_ft.trainer.PipelineTrainer` when the schedule gives a process several
    stages, with its arguments."""

    def __init__(self, model: nn.Module | Callable[[], nn.Module], plan: Plan, *,
                 loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 config: PipelineConfig | None = None, env: DistEnv | None = None,
                 extra_state: dict[str, Any] | None = None, profile: Profile | None = None,
                 scheduler_factory: SchedulerFactory | None = None, tied_parameters: Sequence[Sequence[str]] = (),
                 init: Init | None = None) -> None:
        from .trainer import _OPEN, _Milestones

        self.config = config = config or PipelineConfig()
        self._baseline = resident_bytes()
        self.timeline: dict[str, float] = {"start": time.time()}
        self.env = env = env or read_env()
        self.backend, self.device = backend_and_device(env.local_rank, config.backend)
        schedule = resolve_schedule(planned_schedule(config.schedule, plan.settings))
        if not runs_virtual(schedule):
            raise PlanError(f"the schedule {schedule} runs one stage per process")
        if not isinstance(model, nn.Module):
            model = model()
        if tied_parameters:
            tie_declared(model, tied_parameters)
        model_hash = None
        if config.check_model_hash:
            from profiler.layers import structure_profile

            model_hash = structure_profile(model).structure_hash()
        if profile is not None and profile.structure_hash() != plan.profile_hash:
            raise PlanError(f"the profile (hash {profile.structure_hash()[:12]}) is not the plan's model "
                            f"(hash {plan.profile_hash[:12]})")
        self.profile = profile
        self.original_plan = plan
        stages = env.world_size * stages_per_process(schedule, plan, env.world_size)
        if plan.num_stages != stages and profile is not None and isinstance(schedule, str):
            # the job runs on another number of processes than the plan was made for: plan as many stages again
            plan = replan_for_world(plan, profile, stages, rank=env.rank)
        layout = virtual_layout(schedule, plan, env.world_size, config.flush_every)
        assert layout is not None
        self.layout = layout
        self.plan = plan
        by_stage = stage_plan(plan)
        names = model_layers(model).names
        by_stage.check_fits(profile_hash=model_hash, num_layers=len(names), world_size=plan.num_stages)
        self.mode: Mode = make_mode(config.mode, config.flush_every, config.update_every, layout)
        self.stage_indices: list[int] = layout.stages_of(env.rank)
        """The stages this process holds, in order."""
        self._pretrained = pretrained_of(model)
        ml = model_layers(model)
        self.facts = {"plan": plan_fact(plan), "model": model_fact(ml.names, ml.root),
                      "mode": mode_fact({"mode": repr(self.mode), "update_every": config.update_every,
                                         "clip_grad_norm": config.clip_grad_norm, "autocast": config.autocast_dtype,
                                         "compensation": config.compensation}),
                      "data": data_fact(seed=config.seed, checkpoint_url=None)}
        """What every process must hold the same of, checked at start-up (see :mod:`pipedream_ft.ft.agreement`)."""
        del ml
        placement = tuple(layout.placement)
        self.connection = Connection(rank=env.rank, world_size=env.world_size, backend=self.backend,
                                     device=self.device, timeout_s=config.timeout_s, links=self._links)
        """The process's one communication handle; each stage talks through its own view of it."""
        self.handoff = Handoff()
        self.ckpt = None
        """No checkpointer: a job that checkpoints runs :mod:`pipedream_ft.virtual_threads` for now."""
        self.coordinator = Coordinator(env, config.timeout_s)
        self.hooks = HookList()
        """The process's hooks (watchdog, progress, milestones); every stage's executor calls them too."""
        self._totals: dict[int, torch.Tensor] = {}
        """A window's reduced norms and overflow flags, per stage, until its update takes them."""
        self.progress = ProgressHook(
            bar=config.progress and env.rank == 0,
            report=self.coordinator.report_progress if plan.num_stages - 1 in self.stage_indices else None,
            last_loss=self._last_loss, reported_loss=self.coordinator.last_loss)
        if config.watchdog_s:
            self.hooks.add(WatchdogHook(Watchdog(config.watchdog_s, rank=env.rank, health_file=config.health_file),
                                        self.stage_indices[0]))
        self.hooks.add(self.progress)
        self.hooks.add(_Milestones(self.timeline, lambda: []))
        copies = [model] + [copy.deepcopy(model) for _ in self.stage_indices[1:]]  # each stage keeps its own layers
        del model
        self.stages: list[_Stage] = []
        colocated = frozenset(self.stage_indices)
        for k, s in enumerate(self.stage_indices):
            self.stages.append(self._build(copies[k], by_stage, s, k, placement, colocated, loss_fn,
                                           optimizer_factory, extra_state, scheduler_factory, init))
            copies[k] = None  # type: ignore[call-overload]
        del copies
        self._start()
        self.timeline["restored"] = time.time()
        self.hooks.on_event("start", attempt=env.restart_count, resumed_from=None)
        _OPEN.add(self)  # type: ignore[arg-type]

    def _build(self, model: nn.Module, plan: Plan, s: int, k: int, placement: tuple[int, ...],
               colocated: frozenset[int], loss_fn: Callable[[Any, Any], torch.Tensor],
               optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
               extra_state: dict[str, Any] | None, scheduler_factory: SchedulerFactory | None,
               init: Init | None) -> _Stage:
        """Stage ``s`` (this process's ``k``-th) of ``plan``, from its own copy ``model`` of the model."""
        config, env = self.config, self.env
        topo = Topology.of(plan, s)
        self.mode.check(topo)
        ml = model_layers(model)
        module = build_stage(ml, plan, s)
        if init is not None or has_meta(model):  # only this stage's tensors get storage (and values)
            materialize_stage(model, [module], init=init, seed=config.seed, also=[ml.root])
        module = module.to(self.device)
        connection = StageConnection(self.connection, StageRoute(s, placement), self.handoff)
        specs = find_tied(ml, executed_layers(ml, plan.layer_to_stage, plan.num_stages, plan.recompute))
        tied = None
        if any(s in spec.stages for spec in specs):
            objects = dict(ml.root.named_parameters(remove_duplicate=False))
            tied = TiedParameters(specs, objects, module, topo, self.mode, optimizer_factory, connection=connection)
            tied.defer = True  # a holder on this process may give its gradient later in the same window's updates
        self._tied_specs = specs
        state = StageState(module, optimizer_factory, stage=s, replica=0, keep=self.mode.versions_kept(topo),
                           extra=extra_state, tied=tied)
        meter = ActivationMeter(lambda: [t for t in state.versions.current.tensors])
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
        stepper = Stepper(state, topo=topo, synchronous=True, connection=connection,
                          clip_grad_norm=config.clip_grad_norm, scaler=scaler, scheduler=scheduler,
                          compensation=config.compensation, delay=self.mode.delay(topo))
        own = HookList()
        if config.trace_dir:
            row = (env.rank, f"rank {env.rank} · stages {', '.join(map(str, self.stage_indices))}")
            own.add(TimelineHook(TimelineRecorder(config.trace_dir, rank=env.rank * len(self.stage_indices) + k,
                                                  stage=s, replica=0, attempt=env.restart_count,
                                                  process=env.incarnation, row=row), 0))
        own.add(meter)
        hooks = HookList()
        for h in (*own.hooks, *self.hooks.hooks):
            hooks.add(h)
        totals = self._totals
        executor = Executor(topo, state, self.mode, connection=connection, device=self.device, loss_fn=loss_fn,
                            seed=config.seed, hooks=hooks, step=lambda: stepper.step(totals.pop(s, None)),
                            autocast=autocast_context(config.autocast_dtype, self.device),
                            loss_factor=(lambda: scaler.scale) if scaler is not None else None,
                            colocated=colocated - {s}, handoff=self.handoff)
        stage = _Stage(topo, state, stepper, executor, connection, data_state, meter, own)
        if config.metrics_dir:
            writer = MetricsWriter(config.metrics_dir, env.rank * len(self.stage_indices) + k)
            metrics = MetricsHook(writer, rank=env.rank, stage=s, attempt=env.restart_count,
                                  stats=lambda: executor.stats, last_loss=self._last_loss,
                                  extra=lambda: {"restarts": env.restart_count})
            own.add(metrics)
            hooks.add(metrics)
        return stage

    def _links(self) -> list[tuple[int, str]]:
        return stage_links(self.layout.placement, self.stage_indices, [spec.stages for spec in self._tied_specs])

    def _start(self) -> None:
        """Agree with every process on what they run, and form the process groups."""
        epoch = self.coordinator.new_epoch()
        agree(epoch.store, rank=self.env.rank, world_size=self.env.world_size, facts=self.facts,
              timeout_s=self.config.timeout_s)
        self.connection.configure(epoch.store)
        self.timeline["joined"] = time.time()

    # -- training ---------------------------------------------------------------------------------------------

    @property
    def position(self) -> int:
        """Minibatches trained so far (the data position)."""
        return self.stages[0].state.position

    @property
    def resumed_from(self) -> int | None:
        return None

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        return []

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        return self.plan.num_stages - 1 in self.stage_indices

    @property
    def stats(self) -> RankStats:
        return merged_stats([st.executor.stats for st in self.stages])

    def _last_loss(self) -> float | None:
        last = self.stages[-1].executor.losses if self.is_last else []
        return last[-1][1] if last else None

    def _feeds(self, data: Any, steps: int) -> None:
        for st in self.stages:
            st.feed = training_feed(data, st.feed, topo=st.topo, connection=st.connection,  # type: ignore[arg-type]
                                    component=st.data_state, position=self.position, steps=steps,
                                    checkpointing=False)

    def preflight(self, data: Any) -> None:
        """Check every stage on one minibatch before training (see :meth:`Executor.preflight`). A collective."""
        self._feeds(data, 0)
        self._preflight()

    def _preflight(self) -> None:
        for st in self.stages:  # first every stage's targets on their way (the last stage waits for them)
            assert st.feed is not None
            st.feed.prepare(self.position)
        errors = [st.executor.preflight_check(st.feed) for st in self.stages]  # type: ignore[arg-type]
        agree_preflight(self.connection.group, errors)
        for st in self.stages:
            st.executor.preflight_done = True

    def schedule(self, start: int, stop: int) -> list[Action]:
        """This process's compute and update actions for minibatches ``[start, stop)``, in order."""
        return self.layout.rank_actions(self.env.rank, start, stop)

    def train(self, data: Any, steps: int) -> TrainResult:
        """Train minibatches ``position .. position + steps - 1`` and drain the pipeline (see
        :meth:`PipelineTrainer.train <pipedream_ft.trainer.PipelineTrainer.train>`). A collective."""
        window = self.mode.window(self.stages[0].topo)
        if steps < 0 or steps % window:
            raise InvalidArgument(f"steps must be a non-negative multiple of {window} for this plan and mode, "
                                  f"got {steps}")
        self._feeds(data, steps)
        start = self.position
        stop = start + steps
        for st in self.stages:
            st.executor.losses = []
        t0 = time.perf_counter()
        self._each_hooks(lambda h: h.on_train_start(start, stop))
        mark_training()
        try:
            self._run(start, stop)
            self._each_hooks(lambda h: h.on_event("gathering"))
            losses = self._gather_losses()
            trained = time.perf_counter()
        except PipelineSetupError as exc:  # every process stops with the same line
            if exc.agreed:
                raise
            self.coordinator.publish_job_error(str(exc))
            error = self.coordinator.job_error()
            if error is not None:
                raise JobError(error) from exc
            raise
        except PeerTimeoutError:
            error = self.coordinator.job_error()
            if error is not None:
                raise JobError(error) from None
            raise
        finally:
            self._each_hooks(lambda h: h.on_train_end(start, stop))
        for st in self.stages:
            st.state.position = stop
        self.progress.report(stop, force=True)
        seconds = trained - t0
        result = TrainResult(losses, start, seconds, self.stats, trained=stop - start)
        if self.config.summary:
            rows = self.connection.group.all_gather_object([{**self._stats_row(st), "seconds": seconds}
                                                            for st in self.stages])
            if self.env.rank == 0:
                print(summary_table([r for part in rows for r in part]), flush=True)
        return result

    def fit(self, data: Any, total: int) -> TrainResult:
        """Train until ``total`` minibatches are done in all. A collective."""
        return self.train(data, max(0, total - self.position))

    def _each_hooks(self, call: Callable[[Hooks], None]) -> None:
        """Call the process's hooks once and every stage's own hooks."""
        call(self.hooks)
        for st in self.stages:
            call(st.own)

    def _run(self, start: int, stop: int) -> None:
        """Run this process's lowered list for minibatches ``[start, stop)`` (see the module docstring)."""
        if not all(st.executor.preflight_done for st in self.stages):
            self._preflight()
        by_stage = {st.index: st for st in self.stages}
        actions = process_actions(self.layout, self.env.rank, start, stop)
        i, n = 0, len(actions)
        while i < n:
            action = actions[i]
            if action.kind is Kind.U:
                i = self._updates(actions, i, by_stage)
                continue
            st = by_stage[action.stage]
            st.executor.hooks.on_action(action)
            st.executor.run(action, st.feed)  # type: ignore[arg-type]
            i += 1
        for st in self.stages:
            if st.state.tied:
                st.state.tied.drain(stop // self.mode.update_unit(st.topo))
        self._each_hooks(lambda h: h.on_event("draining"))
        for st in self.stages:
            st.connection.flush()
        if len(self.handoff):
            raise PipelineSetupError(f"process {self.env.rank}: {len(self.handoff)} value(s) handed between its stages "
                                     "were never taken: the lowered schedule is out of order")

    def _updates(self, actions: list[Action], i: int, by_stage: dict[int, _Stage]) -> int:
        """Run the window's updates that start at ``actions[i]`` (with the sends and receives among them, in the
        list's order) together, as the module docstring says: one all-reduce of every stage's norms and flags
        first (when clipping or scaling), and the tied updates once every holder here has given its gradient.
        Returns the index after them."""
        j = i
        while j < len(actions) and (actions[j].kind is Kind.U or actions[j].kind in COMMUNICATION):
            j += 1
        group = actions[i:j]
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
        for a in group:
            st = by_stage[a.stage]
            st.executor.hooks.on_action(a)
            st.executor.run(a, st.feed)  # type: ignore[arg-type]
        for a, st in zip(updates, stages):
            if st.state.tied:
                st.state.tied.drain(a.index + 1)
        return j

    def _gather_losses(self) -> list[float]:
        mine = self.stages[-1].executor.losses if self.is_last else []
        merged = sorted(x for part in self.connection.group.all_gather_object(mine) for x in part)
        return [loss for _, loss in merged]

    # -- results ----------------------------------------------------------------------------------------------

    def _stats_row(self, st: _Stage) -> dict[str, Any]:
        return {"rank": self.env.rank, "stage": st.index, **st.executor.stats.as_dict()}

    def memory_report(self) -> MemoryReport:
        """This process's memory: its stages' weights, gradients, optimizer state and activations together (see
        :mod:`pipedream_ft.pipeline.memory_report`)."""
        modules = nn.ModuleList([st.state.module for st in self.stages])
        tied = [g for st in self.stages if st.state.tied for g in st.state.tied.groups]
        return memory_report(stage=self.stage_indices[0], module=modules,
                             optimizers=[*(st.state.optimizer for st in self.stages), *(g.optimizer for g in tied)],
                             trainable=[p for st in self.stages for p in st.state.all_live_params],
                             stash_bytes=self.stats.peak_stash_bytes, meter=self.stages[0].meter,
                             device=self.device, baseline=self._baseline, predicted=None,
                             limit=self.plan.settings.get("memory_bytes"))

    def gather_stats(self) -> list[dict[str, Any]]:
        """Every stage's :class:`RankStats` of the last :meth:`train` (with its process's rank, its stage and its
        process's memory report), in stage order, on every process. A collective."""
        memory = self.memory_report().as_dict()
        rows = self.connection.group.all_gather_object([{**self._stats_row(st), "memory": memory}
                                                        for st in self.stages])
        return sorted((r for part in rows for r in part), key=lambda r: r["stage"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights (original keys), gathered from every stage onto every process. A collective."""
        mine = {k: v.detach().cpu() for k, v in _StateDicts([st.state.module for st in self.stages]).state_dict().items()}
        out: dict[str, torch.Tensor] = {}
        for part in self.connection.group.all_gather_object(mine):
            out.update(part or {})
        return out

    def evaluate(self, data: Any, steps: int, metric_fn: MetricFn | None = None) -> EvalResult:
        """Mean loss (and metrics) of minibatches ``0 .. steps - 1`` of ``data`` through every stage, forward only
        (see :mod:`pipedream_ft.pipeline.evaluate`). A collective."""
        feed = self.stages[0].feed
        return evaluate_stages([st.executor for st in self.stages], data, steps, metric_fn,
                               training_source=feed.source if feed is not None else None)

    def save_model(self, path: str, format: str = "torch") -> None:
        """Write the whole model's weights to ``path`` (see :meth:`PipelineTrainer.save_model
        <pipedream_ft.trainer.PipelineTrainer.save_model>`). A collective."""
        save_model(self.connection.messenger, _StateDicts([st.state.module for st in self.stages]),  # type: ignore[arg-type]
                   replica=0, path=path, format=format, stage=self.stage_indices[0])

    def save_pretrained(self, directory: str, max_shard_bytes: int = 5 * 10**9) -> None:
        """Write the whole model as a Hugging Face directory (see :meth:`PipelineTrainer.save_pretrained
        <pipedream_ft.trainer.PipelineTrainer.save_pretrained>`). A collective."""
        save_pretrained(self.connection.messenger, _StateDicts([st.state.module for st in self.stages]),  # type: ignore[arg-type]
                        replica=0, directory=directory, pretrained=self._pretrained, max_shard_bytes=max_shard_bytes,
                        stage=self.stage_indices[0])

    def close(self) -> None:
        """Stop the hooks' threads, close the traces and shut the process groups down. Idempotent."""
        try:
            self._each_hooks(lambda h: h.close())
        finally:
            self.release()

    def release(self) -> None:
        """Shut the process groups down now (idempotent; also done at interpreter exit)."""
        from .trainer import _OPEN

        for st in self.stages:
            st.executor.abandon()
            st.connection.forget()
        self.connection.release()
        _OPEN.discard(self)  # type: ignore[arg-type]
