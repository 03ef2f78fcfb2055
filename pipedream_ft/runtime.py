"""The pipeline runtime: each rank runs one stage of a plan, PipeDream-style.

Semantics (mode ``"stash"``, PipeDream's default): minibatches flow through the stages in 1F1B order with no
flush. Stage ``s`` of an ``S``-stage straight pipeline runs the forward and the backward of minibatch ``b``
with its weights after ``max(0, b - (S - 1 - s))`` updates (weight stashing), and applies update ``b`` as soon
as that backward is done. ``"vertical"`` makes every stage use the version stage 0 used for the minibatch
(vertical sync). ``"flush"`` runs 1F1B over windows of ``flush_every`` minibatches, averages their gradients and
takes one optimizer step per window: synchronous minibatch SGD.

Replicated stages all-reduce their gradients among themselves before each update; minibatches are dealt to
replicas round-robin.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from partitioner.plan import Plan, PlanError

from .comm import Header, Messenger, RecvHandle, ShapeMismatchError, TensorSpec
from .distributed import default_device, init_distributed
from .env import DistEnv
from .errors import PipelineSetupError
from .schedule import Action, flushing, in_flight, one_f_one_b
from .stage import StageModule, build_stage, model_layers
from .versions import Version, VersionStore
from .checkpointing import CheckpointConfig, Checkpointer
from .distributed import job_store
from .faults import FaultInjector
from .metrics import MetricsWriter, summary_table
from .timeline import TimelineRecorder
from .watchdog import Watchdog
from .checkpoint import Storage
from .elastic import describe_plan, load_stored_profile, merge_parts, replan
from profiler.profile import Profile

__all__ = ["MODES", "PipelineConfig", "RankStats", "TrainResult", "PipelineTrainer"]

log = logging.getLogger(__name__)

MODES = ("stash", "vertical", "flush")
FLAG_FAILED = 1
"""Header flag: the upstream stage failed its pre-flight check."""
FLAG_CHECKPOINT = 2
"""Header flag: every stage saves a checkpoint after this minibatch's update."""
FLAG_STOP = 4
"""Header flag: and then stops (a preemption)."""

DataFn = Callable[[int], tuple[Any, Any]]
"""``data(b) -> (inputs, targets)`` of minibatch ``b``; every rank must see the same stream."""


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """How the pipeline trains."""

    mode: str = "stash"
    """``"stash"`` (asynchronous 1F1B with weight stashing), ``"vertical"`` (plus vertical sync) or ``"flush"``."""
    flush_every: int = 4
    """Minibatches per optimizer step in ``"flush"`` mode."""
    timeout_s: float = 45.0
    """Longest wait for a peer (a transfer, an all-reduce) before the rank fails naming it."""
    watchdog_s: float | None = 60.0
    """Fail the rank if it makes no progress at all for this long (``None``: no watchdog)."""
    health_file: str | None = field(default_factory=lambda: os.environ.get("PIPEDREAM_FT_HEALTH_FILE"))
    trace_dir: str | None = field(default_factory=lambda: os.environ.get("PIPEDREAM_FT_TRACE_DIR"))
    """Write this rank's timeline (Chrome/Perfetto trace) here; default ``$PIPEDREAM_FT_TRACE_DIR``."""
    metrics_dir: str | None = field(default_factory=lambda: os.environ.get("PIPEDREAM_FT_METRICS_DIR"))
    """Write this rank's metrics (JSON lines, one per update) here; default ``$PIPEDREAM_FT_METRICS_DIR``."""
    progress: bool = True
    """A progress bar on rank 0 (only when stderr is a terminal)."""
    summary: bool = True
    """Print a per-rank summary table on rank 0 at the end of :meth:`PipelineTrainer.train`."""
    """Refreshed while the rank makes progress (for liveness probes); default ``$PIPEDREAM_FT_HEALTH_FILE``."""
    seed: int = 0
    """Seeds each forward's RNG from (seed, stage, minibatch), so dropout is reproducible across restarts."""
    check_model_hash: bool = True
    """Refuse a plan whose profile hash differs from the model's structure."""
    backend: str | None = None
    """``"nccl"`` or ``"gloo"``; default NCCL when CUDA is available."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {self.flush_every}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass(slots=True)
class RankStats:
    """Where one rank's time went, and what it held."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    update_s: float = 0.0
    wait_s: float = 0.0
    """Time blocked waiting for activations or gradients."""
    minibatches: int = 0
    peak_stash_versions: int = 0
    """Most weight versions alive at once (the current one included)."""
    peak_stash_bytes: int = 0
    """Bytes of those versions."""


@dataclass(slots=True)
class TrainResult:
    """What :meth:`PipelineTrainer.train` returns on every rank."""

    losses: list[float]
    """Loss of each minibatch trained, in minibatch order."""
    start: int
    """First minibatch number of this call."""
    seconds: float
    stats: RankStats = field(default_factory=RankStats)


@dataclass(slots=True)
class _InFlight:
    version: Version
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    loss: torch.Tensor | None
    grad_recv: RecvHandle | None
    header: Header


class PipelineTrainer:
    """Runs this rank's stage of ``plan``.

    ``model`` is the whole model (an ``nn.Sequential`` or an fx-traceable module) or a zero-argument factory
    for it; only this rank's layers are kept. ``optimizer_factory(params)`` builds the stage's optimizer.
    The default process group is joined if it is not already (see :func:`init_distributed`).
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
    ) -> None:
        """``profile`` (the model's profile) lets a job whose world size changed re-plan; with checkpointing it is
        also stored beside the checkpoints, so later attempts can re-plan without it."""
        self.config = config or PipelineConfig()
        self.timeline: dict[str, float] = {"start": time.time()}
        """Wall-clock times of this attempt's milestones: start, joined, restored, first_update."""
        self.env = init_distributed(env, backend=self.config.backend, timeout_s=self.config.timeout_s)
        self.timeline["joined"] = time.time()
        self.backend = dist.get_backend()
        self.device = default_device(self.env, self.backend)
        if not isinstance(model, nn.Module):
            model = model()
        ml = model_layers(model)
        model_hash = None
        if self.config.check_model_hash:
            from profiler.layers import structure_profile

            model_hash = structure_profile(model).structure_hash()
        self.profile = profile
        if profile is not None and profile.structure_hash() != plan.profile_hash:
            raise PlanError(f"the profile (hash {profile.structure_hash()[:12]}) is not the plan's model "
                            f"(hash {plan.profile_hash[:12]})")
        self.original_plan = plan
        if plan.world_size != self.env.world_size and len(ml.names) == plan.num_layers:
            plan = self._replan(plan, checkpoint)
        plan.check_fits(profile_hash=model_hash, num_layers=len(ml.names), world_size=self.env.world_size)
        self.plan = plan
        self.replicas = [s.replicas for s in plan.stages]
        if self.config.mode == "vertical" and len(set(self.replicas)) > 1:
            raise PlanError(f"vertical sync needs one replica count on every stage, the plan has {self.replicas}")
        my = plan.stage_of_rank(self.env.rank)
        self.stage_index = my.index
        self.replica = my.ranks.index(self.env.rank)
        self.num_stages = plan.num_stages
        self.is_first = self.stage_index == 0
        self.is_last = self.stage_index == self.num_stages - 1
        self.module: StageModule = build_stage(ml, plan, self.stage_index).to(self.device)
        del ml, model
        self.params = [p for p in self.module.parameters()]
        self._param_names = [n for n, _ in self.module.named_parameters()]
        self.optimizer = optimizer_factory(self.params)
        self.loss_fn = loss_fn
        self._replica_group = self._make_groups()
        self.messenger = Messenger(self.device, self.config.timeout_s, self._make_link_groups())
        self.versions = VersionStore(self.params, keep=self._versions_kept())
        self.position = 0
        """Minibatches trained so far (the data position)."""
        self._inflight: dict[int, _InFlight] = {}
        self._act_recv: dict[int, RecvHandle] = {}
        self._losses: list[tuple[int, float]] = []
        self._preflight_done = False
        self._generator = torch.cuda.default_generators[self.device.index or 0] if self.device.type == "cuda" \
            else torch.default_generator
        self.stats = RankStats()
        self._cuts: dict[int, bool] = {}
        """Checkpoint cuts announced to this rank and not yet reached (cut -> stop after it)."""
        self.extra_state = dict(extra_state or {})
        self.store = job_store()
        self.faults = FaultInjector.from_env(rank=self.env.rank, attempt=self.env.restart_count)
        self.watchdog = Watchdog(self.config.watchdog_s, rank=self.env.rank, health_file=self.config.health_file) \
            if self.config.watchdog_s else None
        self._progress = _ProgressReporter(self.store)
        self.recorder = TimelineRecorder(self.config.trace_dir, rank=self.env.rank, stage=self.stage_index,
                                         replica=self.replica, attempt=self.env.restart_count) \
            if self.config.trace_dir else None
        self.metrics = MetricsWriter(self.config.metrics_dir, self.env.rank) if self.config.metrics_dir else None
        self.redone = 0
        self._mark: dict[str, float] = {}
        self._train_t0 = time.perf_counter()
        self._bar: Any = None
        self._bar_polled = 0.0
        self.ckpt = Checkpointer(self, checkpoint, self.faults) if checkpoint is not None else None
        self.resumed_from = self.ckpt.resume() if self.ckpt is not None else None
        self.timeline["restored"] = time.time()
        if self.recorder is not None:
            self.recorder.instant("start", "restart", attempt=self.env.restart_count, resumed_from=self.resumed_from)
        if self.resumed_from is not None:
            self._log_resume()

    # -- set-up ---------------------------------------------------------------------------------------------

    def _replan(self, plan: Plan, checkpoint: CheckpointConfig | None) -> Plan:
        """The world size is not the plan's: plan again for it (see :mod:`pipedream_ft.elastic`)."""
        profile = self.profile
        if profile is None:
            if checkpoint is None:
                raise PlanError(f"plan needs {plan.world_size} workers, but the world size is {self.env.world_size} "
                                "(pass profile= to re-plan for the new size)")
            profile = load_stored_profile(Storage(checkpoint.url, checkpoint.storage_options))
            if profile.structure_hash() != plan.profile_hash:
                raise PipelineSetupError("the profile stored with the checkpoints is not this plan's model")
        new = replan(profile, self.env.world_size, plan.settings)
        if self.env.rank == 0:
            msg = (f"world size {self.env.world_size} differs from the plan's {plan.world_size}: re-planned from "
                   f"{describe_plan(plan)} to {describe_plan(new)}")
            log.warning(msg)
            print(f"pipedream-ft: {msg}", flush=True)
        return new

    def _versions_kept(self) -> int:
        if self.config.mode == "flush":
            return 0
        stage = 0 if self.config.mode == "vertical" else self.stage_index
        return in_flight(stage, self.replicas) - 1

    def _version_for(self, b: int, header: Header) -> Version:
        """The weights minibatch ``b``'s forward uses here (see the module docstring)."""
        if self.config.mode == "flush":
            return self.versions.current
        if self.config.mode == "vertical" and not self.is_first:
            return self.versions.get(header.tag)
        round_ = b // self.replicas[self.stage_index]
        return self.versions.get(max(0, round_ - (in_flight(self.stage_index, self.replicas) - 1)))

    def _make_groups(self) -> Any:
        """Create every stage's replica group (a collective: all ranks create all groups, in one order)."""
        mine = None
        for stage in self.plan.stages:
            if stage.replicas > 1:
                g = dist.new_group(list(stage.ranks))
                if stage.index == self.stage_index:
                    mine = g
        return mine

    def _make_link_groups(self) -> dict[tuple[int, str], Any]:
        """Under NCCL, one communicator per link and direction (a collective, like :meth:`_make_groups`).

        NCCL matches point-to-point operations between two ranks by order alone; giving activations and
        gradients their own communicators leaves each with a single stream of messages in minibatch order,
        so receives can be posted ahead without the two directions blocking each other. Gloo matches by tag
        and needs none.
        """
        links: dict[tuple[int, str], Any] = {}
        if self.backend != "nccl":
            return links
        me = self.env.rank
        for s in range(self.num_stages - 1):
            up, down = self.plan.stages[s], self.plan.stages[s + 1]
            g = math.gcd(up.replicas, down.replicas)
            for i, a in enumerate(up.ranks):
                for j, c in enumerate(down.ranks):
                    if i % g != j % g:
                        continue
                    for direction in ("act", "grad"):
                        group = dist.new_group([a, c])
                        if me in (a, c):
                            links[(c if me == a else a, direction)] = group
        return links

    def _peer(self, stage: int, minibatch: int) -> int:
        s = self.plan.stages[stage]
        return s.ranks[minibatch % s.replicas]

    def _peers(self, stage: int) -> list[int]:
        """Ranks of ``stage`` that exchange minibatches with this rank."""
        here, there = self.replicas[self.stage_index], self.replicas[stage]
        g = math.gcd(here, there)
        return [r for i, r in enumerate(self.plan.stages[stage].ranks) if i % g == self.replica % g]

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(self.device, non_blocking=True)
        if isinstance(value, (list, tuple)):
            return type(value)(self._to_device(v) for v in value)
        if isinstance(value, dict):
            return {k: self._to_device(v) for k, v in value.items()}
        return value

    def _model_inputs(self, inputs: Any) -> list[Any]:
        vals = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        if len(vals) != len(self.module.input_names):
            raise PipelineSetupError(
                f"the model takes {len(self.module.input_names)} inputs {self.module.input_names}, but the data "
                f"gives {len(vals)}"
            )
        return self._to_device(vals)

    def preflight(self, data: DataFn) -> None:
        """Push one minibatch forward through every stage (no gradients, eval mode) before training.

        Every link learns its tensor shapes, and a stage that cannot take what the previous one sends — or a
        mismatch between the data and the model — stops every rank with one message naming it. A collective.
        """
        error: str | None = None
        failed_upstream = False
        was_training = self.module.training
        outs: list[torch.Tensor] = []
        try:
            self.module.eval()
            if self.is_first:
                inputs = self._model_inputs(data(self.position)[0])
            else:
                received = []
                for peer in self._peers(self.stage_index - 1):
                    header, tensors = self.messenger.post_activations(peer, -1).wait()
                    assert header is not None
                    if header.flags & FLAG_FAILED:
                        failed_upstream = True
                    received.append(tensors)
                inputs = received[0] if received else []
            if not failed_upstream:
                with torch.no_grad():
                    out = self.module(*inputs)
                if self.is_last:
                    loss = self.loss_fn(out, self._to_device(data(self.position)[1]))
                    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                        raise PipelineSetupError(f"loss_fn must return a scalar tensor, got {loss!r:.80}")
                else:
                    outs = list(out)
                    bad = [n for n, t in zip(self.module.output_names, outs) if not isinstance(t, torch.Tensor)]
                    if bad:
                        raise PipelineSetupError(f"only tensors can cross stages; {bad} are not tensors")
        except Exception as exc:  # any failure here is reported collectively below
            what = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            shapes = ", ".join(str(TensorSpec.of(t)) for t in inputs if isinstance(t, torch.Tensor)) \
                if "inputs" in locals() else "?"
            error = (f"stage {self.stage_index} (rank {self.env.rank}, layers {_ranges(self.plan.stages[self.stage_index].layers)}) "
                     f"cannot run on its input [{shapes}]: {what}")
        finally:
            self.module.train(was_training)
        if not self.is_last:
            flags = FLAG_FAILED if (error or failed_upstream) else 0
            for peer in self._peers(self.stage_index + 1):
                self.messenger.send_activations(peer, Header(-1, 0, flags), [] if flags else outs)
            self.messenger.flush()
        errors: list[str | None] = [None] * self.env.world_size
        dist.all_gather_object(errors, error)
        problems = [e for e in errors if e]
        if problems:
            raise PipelineSetupError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        self._preflight_done = True

    # -- the schedule ---------------------------------------------------------------------------------------

    def schedule(self, start: int, stop: int) -> list[Action]:
        if self.config.mode == "flush":
            return flushing(self.stage_index, self.replica, self.replicas, start, stop, self.config.flush_every)
        return one_f_one_b(self.stage_index, self.replica, self.replicas, start, stop)

    def train(self, data: DataFn, steps: int) -> TrainResult:
        """Train minibatches ``position .. position + steps - 1`` and drain the pipeline. A collective.

        ``steps`` counts minibatches (PipeDream's unit of work; in ``"flush"`` mode, ``flush_every`` of them
        make one optimizer step) and must be a multiple of every stage's replica count.
        """
        lcm = math.lcm(*self.replicas)
        if self.config.mode == "flush":
            lcm = math.lcm(lcm, self.config.flush_every)
        if steps < 0 or steps % lcm:
            raise ValueError(f"steps must be a non-negative multiple of {lcm} for this plan and mode, got {steps}")
        if not self._preflight_done:
            self.preflight(data)
        start, stop = self.position, self.position + steps
        actions = self.schedule(start, stop)
        forwards = [i for i, a in enumerate(actions) if a.kind == "F"]
        t0 = time.perf_counter()
        self._train_t0 = t0
        self._mark = {}
        self._losses = []
        self._bar = self._progress_bar(start, stop)
        if self.watchdog is not None:
            self.watchdog.arm()
        try:
            nxt = 0  # first forward at or after the current action
            for i, action in enumerate(actions):
                # post the next receive before computing: this forward's and the next one's
                while nxt < len(forwards) and forwards[nxt] < i:
                    nxt += 1
                for j in forwards[nxt: nxt + (2 if action.kind == "F" else 1)]:
                    self._post_activation_recv(actions[j].index)
                if self.watchdog is not None:
                    self.watchdog.beat(f"running {action} on stage {self.stage_index}")
                if action.kind == "F":
                    self._forward(action.index, data)
                elif action.kind == "B":
                    self._backward(action.index)
                else:
                    self._update(action.index)
                if self.ckpt is not None:
                    self.ckpt.announce_preemption()
            if self.watchdog is not None:
                self.watchdog.beat("waiting for the last sends")
            self.messenger.flush()
        finally:
            if self.watchdog is not None:
                self.watchdog.disarm()
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            for sink in (self.recorder, self.metrics):
                if sink is not None:
                    sink.flush()
        self.position = stop
        self._record_progress(stop, force=True)
        seconds = time.perf_counter() - t0
        result = TrainResult(self._gather_losses(), start, seconds, self.stats)
        if self.config.summary:
            self._print_summary(seconds)
        return result

    def _progress_bar(self, start: int, stop: int) -> Any:
        if self.env.rank != 0 or not self.config.progress or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        self._bar_polled = 0.0
        return tqdm(total=stop, initial=start, unit="mb", desc="training", dynamic_ncols=True, leave=True)

    def _print_summary(self, seconds: float) -> None:
        """Gather every rank's statistics and print a table on rank 0. A collective."""
        mine = {"rank": self.env.rank, "stage": self.stage_index, "seconds": seconds,
                **{k: getattr(self.stats, k) for k in RankStats.__slots__}}  # type: ignore[attr-defined]
        rows: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(rows, mine)
        if self.env.rank == 0:
            print(summary_table(rows), flush=True)

    def fit(self, data: DataFn, total: int) -> TrainResult:
        """Train until ``total`` minibatches are done in all, continuing from a resumed checkpoint's position;
        then wait for pending checkpoints to commit. A collective."""
        result = self.train(data, max(0, total - self.position))
        if self.ckpt is not None:
            self.ckpt.finish()
        return result

    def close(self) -> None:
        """Stop the background threads and the checkpoint writer (waiting for pending commits); close the trace."""
        self._progress.close()
        if self.watchdog is not None:
            self.watchdog.close()
        if self.ckpt is not None:
            self.ckpt.close()
        for sink in (self.recorder, self.metrics):
            if sink is not None:
                sink.close()

    def _post_activation_recv(self, b: int) -> None:
        if not self.is_first and b not in self._act_recv:
            self._act_recv[b] = self.messenger.post_activations(self._peer(self.stage_index - 1, b), b)

    # -- actions --------------------------------------------------------------------------------------------

    def _forward(self, b: int, data: DataFn) -> None:
        if self.faults:
            self.faults.at_forward(b)
        if self.is_first:
            inputs = self._model_inputs(data(b)[0])
            flags = 0
            if self.ckpt is not None:
                save, stop = self.ckpt.flags_for(b)
                if stop and not save:
                    self.ckpt.stop_without_save()
                if save:
                    flags = FLAG_CHECKPOINT | (FLAG_STOP if stop else 0)
                    self._cuts[b + 1] = stop
            header = Header(b, 0, flags)
            header = Header(b, self._version_for(b, header).updates, flags)
        else:
            if b not in self._act_recv:
                self._post_activation_recv(b)
            handle = self._act_recv.pop(b)
            header, inputs = handle.wait()  # type: ignore[assignment]
            self.stats.wait_s += handle.wait_s
            self._record_wait(handle, "activation")
            assert header is not None
            inputs = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
            if header.flags & FLAG_CHECKPOINT:
                self._cuts[b + 1] = bool(header.flags & FLAG_STOP)
        t0 = time.perf_counter()
        w0 = time.time()
        version = self._version_for(b, header)
        params = dict(zip(self._param_names, version.tensors))
        gen = self._generator
        saved = gen.get_state()
        gen.manual_seed(_mix(self.config.seed, self.stage_index, b))  # this forward's RNG, reproducible
        try:
            out = functional_call(self.module, params, tuple(inputs))
        finally:
            gen.set_state(saved)  # the caller's RNG stream is left as it was
        loss = None
        outputs: list[torch.Tensor] = []
        grad_recv = None
        if self.is_last:
            loss = self.loss_fn(out, self._to_device(data(b)[1]))
            self._losses.append((b, float(loss.detach())))
            if self.config.mode == "flush":
                loss = loss / self.config.flush_every
        else:
            outputs = list(out)
            for name, t in zip(self.module.output_names, outputs):
                if not isinstance(t, torch.Tensor):
                    raise ShapeMismatchError(f"only tensors can cross stages; {name} is {type(t).__name__}")
            peer = self._peer(self.stage_index + 1, b)
            self.messenger.send_activations(peer, header, outputs)
            specs = [TensorSpec.of(t) for t in outputs if t.is_floating_point()]
            grad_recv = self.messenger.post_gradients(peer, b, specs)
        self._inflight[b] = _InFlight(version, list(inputs), outputs, loss, grad_recv, header)
        self.stats.forward_s += time.perf_counter() - t0
        if self.recorder is not None:
            self.recorder.complete(f"F{b}", "forward", w0, time.time(), minibatch=b, replica=self.replica)
        self._note_stash()

    def _backward(self, b: int) -> None:
        rec = self._inflight.pop(b)
        if self.is_last:
            assert rec.loss is not None
            roots, grads = [rec.loss], [None]
        else:
            assert rec.grad_recv is not None
            _, received = rec.grad_recv.wait()
            self.stats.wait_s += rec.grad_recv.wait_s
            self._record_wait(rec.grad_recv, "gradient")
            floats = [t for t in rec.outputs if t.is_floating_point()]
            pairs = [(o, g) for o, g in zip(floats, received) if o.requires_grad]
            roots, grads = [p[0] for p in pairs], [p[1] for p in pairs]
        t0 = time.perf_counter()
        w0 = time.time()
        wrt_params = [t for t in rec.version.tensors if t.requires_grad]
        wrt_inputs = [t for t in rec.inputs if t.is_floating_point() and t.requires_grad] if not self.is_first else []
        wrt = wrt_params + wrt_inputs
        if roots and wrt:
            got = torch.autograd.grad(roots, wrt, grads, allow_unused=True)
        else:
            got = (None,) * len(wrt)
        live = [p for p in self.params if p.requires_grad]
        for p, g in zip(live, got[: len(wrt_params)]):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.detach().clone() if self.config.mode == "flush" else g.detach()
            else:
                p.grad.add_(g)
        if not self.is_first:
            in_grads = [g if g is not None else torch.zeros_like(t) for t, g in zip(wrt_inputs, got[len(wrt_params):])]
            self.messenger.send_gradients(self._peer(self.stage_index - 1, b), b, in_grads)
        self.stats.backward_s += time.perf_counter() - t0
        self.stats.minibatches += 1
        if self.recorder is not None:
            self.recorder.complete(f"B{b}", "backward", w0, time.time(), minibatch=b, replica=self.replica)

    def _update(self, round_: int) -> None:
        t0 = time.perf_counter()
        w0 = time.time()
        live = [p for p in self.params if p.requires_grad]
        per_round = self.config.flush_every if self.config.mode == "flush" else self.replicas[self.stage_index]
        round_end = (round_ + 1) * per_round
        cut_here = round_end in self._cuts
        mark = float(round_end * 2 + int(self._cuts[round_end])) if cut_here else 0.0
        if self._replica_group is not None:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in live]
            flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor([mark], device=self.device)])
            work = dist.all_reduce(flat, group=self._replica_group, async_op=True)
            self.messenger.wait(work, f"gradient all-reduce of update {round_} among replicas "
                                      f"{list(self.plan.stages[self.stage_index].ranks)}")
            marks = flat[-1:]
            flat = flat[:-1]
            if self.config.mode != "flush":
                flat /= self.replicas[self.stage_index]
            offset = 0
            for p in live:
                n = p.numel()
                p.grad = flat[offset: offset + n].view_as(p).clone()
                offset += n
            if float(marks) > 0 and not cut_here:
                # the replica that ran the marked minibatch tells the others through the all-reduce
                self._cuts[round_end] = bool(int(float(marks)) % 2)
                cut_here = True
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.versions.publish()
        self.stats.update_s += time.perf_counter() - t0
        if "first_update" not in self.timeline:
            self.timeline["first_update"] = time.time()
        if self.recorder is not None:
            self.recorder.complete(f"U{round_}", "update", w0, time.time(), round=round_, replica=self.replica)
        self._after_update(round_, round_end)
        self._record_progress(round_end)
        if cut_here and self.ckpt is not None:
            self.ckpt.save(round_end, self._cuts.pop(round_end))

    def _record_wait(self, handle: RecvHandle, what: str) -> None:
        if self.recorder is not None and handle.wait_s > 0:
            end = time.time()
            self.recorder.complete("recv", "wait", end - handle.wait_s, end, minibatch=handle.minibatch, what=what,
                                   peer=handle.peer)

    def _after_update(self, round_: int, done: int) -> None:
        """Metrics record and progress bar, once per update."""
        now = time.perf_counter()
        s = self.stats
        compute = s.forward_s + s.backward_s + s.update_s
        last = self._mark or {"t": self._train_t0, "compute": 0.0, "wait": 0.0}
        step_time = max(1e-9, now - last["t"])
        d_compute, d_wait = compute - last["compute"], s.wait_s - last["wait"]
        self._mark = {"t": now, "compute": compute, "wait": s.wait_s}
        if self._bar is not None:
            self._bar.update(done - self._bar.n)
            if self.store is not None and now - self._bar_polled > 0.5:
                self._bar_polled = now
                try:
                    if self.store.check(["loss"]):
                        self._bar.set_postfix_str(f"loss {float(self.store.get('loss')):.4f}", refresh=False)
                except Exception:  # the display must not stop training
                    pass
        if self.metrics is None:
            return
        record: dict[str, Any] = {
            "rank": self.env.rank, "stage": self.stage_index, "attempt": self.env.restart_count, "update": round_,
            "minibatches": done, "time": time.time(), "step_time_s": step_time, "compute_s": d_compute,
            "wait_s": d_wait, "bubble_fraction": max(0.0, 1.0 - d_compute / step_time),
            "restarts": self.env.restart_count, "redone": self.redone,
        }
        if self.is_last and self._losses:
            record["loss"] = self._losses[-1][1]
        if self.ckpt is not None:
            record.update(self.ckpt.metrics())
        self.metrics.write(record)

    def _record_progress(self, done: int, force: bool = False) -> None:
        """Let a restarted attempt know how far this one got (the last stage's replica 0 reports it)."""
        if self.store is None or not self.is_last or self.replica != 0:
            return
        self._progress.report(done, force, self._losses[-1][1] if self._losses else None)

    def _log_resume(self) -> None:
        """Say where this attempt resumes and how much work the failed one loses (it reported its progress)."""
        reached = None
        if self.store is not None and self.env.restart_count > 0:
            try:
                if self.store.check(["progress"]):
                    reached = int(self.store.get("progress"))
            except Exception:  # the store is informational here
                reached = None
        self.redone = max(0, reached - self.position) if reached is not None else 0
        if self.env.rank == 0:
            redone = f"; the failed attempt had reached minibatch {reached}, so {self.redone} minibatches are redone" \
                if reached is not None else ""
            log.warning("attempt %d resumes from committed checkpoint at minibatch %d (update %d)%s",
                        self.env.restart_count, self.position, self.versions.current.updates, redone)
            print(f"pipedream-ft: resumed from checkpoint {self.position} (attempt {self.env.restart_count})"
                  + (f"; redoing {self.redone} minibatches" if reached is not None else ""), flush=True)

    # -- checkpoint state -----------------------------------------------------------------------------------

    def _capture_state(self, cut: int) -> dict[str, Any]:
        """This rank's part of the checkpoint at ``cut`` (right after its update for minibatch ``cut - 1``)."""
        versions = {u: list(v.tensors) for u, v in self.versions.history.items()}
        state: dict[str, Any] = {
            "position": cut,
            "updates": self.versions.current.updates,
            "stage": self.stage_index,
            "replica": self.replica,
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "param_names": list(self._param_names),
            "versions": versions,
            "rng": torch.get_rng_state(),
            "extra": {name: obj.state_dict() for name, obj in self.extra_state.items()},
        }
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def _restore_resharded(self, parts: list[dict[str, Any]], cut: int) -> int:
        """Load the checkpoint at ``cut`` written under another plan: gather this stage's layers from the old
        stages' ``parts``. The pipeline restarts at the first minibatch >= ``cut`` that every new stage's
        replica count divides; returns it."""
        merged = merge_parts(parts, self._param_names, list(self.module.state_dict()))
        self.module.load_state_dict(merged["model"])
        self.optimizer.load_state_dict(merged["optimizer"])
        lcm = math.lcm(*self.replicas)
        if self.config.mode == "flush":
            lcm = math.lcm(lcm, self.config.flush_every)
        start = -(-cut // lcm) * lcm
        if start != cut and self.env.rank == 0:
            log.warning("the new plan's replica counts need a start at a multiple of %d: minibatches %d..%d are "
                        "skipped", lcm, cut, start - 1)
        self.versions = VersionStore(self.params, updates=start // self.replicas[self.stage_index],
                                     keep=self._versions_kept())
        self.versions.floor = self.versions.current.updates
        self.position = start
        torch.set_rng_state(parts[0]["rng"])
        for name, obj in self.extra_state.items():
            source = next((p["extra"][name] for p in parts if name in p.get("extra", {})), None)
            if source is None:
                raise PipelineSetupError(f"checkpoint has no extra state {name!r}")
            obj.load_state_dict(source)
        return start

    def _restore_state(self, state: dict[str, Any]) -> None:
        if state.get("stage") != self.stage_index or state.get("replica") != self.replica:
            raise PipelineSetupError(
                f"checkpoint part is for stage {state.get('stage')} replica {state.get('replica')}, "
                f"not stage {self.stage_index} replica {self.replica}"
            )
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.versions = VersionStore(self.params, updates=int(state["updates"]), keep=self._versions_kept())
        for u, tensors in state["versions"].items():
            self.versions.add(Version(int(u), tuple(t.to(self.device).requires_grad_(p.requires_grad)
                                                    for t, p in zip(tensors, self.params))))
        self.position = int(state["position"])
        torch.set_rng_state(state["rng"])
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        for name, obj in self.extra_state.items():
            if name not in state["extra"]:
                raise PipelineSetupError(f"checkpoint has no extra state {name!r} (it has {sorted(state['extra'])})")
            obj.load_state_dict(state["extra"][name])

    def _note_stash(self) -> None:
        alive = {id(r.version): r.version for r in self._inflight.values()}
        alive.update({id(v): v for v in self.versions.history.values()})
        alive[id(self.versions.current)] = self.versions.current
        n = len(alive)
        if n > self.stats.peak_stash_versions:
            self.stats.peak_stash_versions = n
            self.stats.peak_stash_bytes = sum(v.nbytes for v in alive.values())

    # -- results --------------------------------------------------------------------------------------------

    def _gather_losses(self) -> list[float]:
        gathered: list[list[tuple[int, float]] | None] = [None] * self.env.world_size
        dist.all_gather_object(gathered, self._losses if self.is_last else [])
        merged = sorted(x for part in gathered if part for x in part)
        return [loss for _, loss in merged]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights (original keys), gathered from the stages onto every rank. A collective."""
        mine = {k: v.detach().cpu() for k, v in self.module.state_dict().items()} if self.replica == 0 else {}
        gathered: list[dict[str, torch.Tensor] | None] = [None] * self.env.world_size
        dist.all_gather_object(gathered, mine)
        out: dict[str, torch.Tensor] = {}
        for part in gathered:
            out.update(part or {})
        return out

    def save_model(self, path: str) -> None:
        """Gather the whole model's weights and save them (rank 0 writes) with ``torch.save``. A collective."""
        state = self.full_state_dict()
        if self.env.rank == 0:
            torch.save(state, path)
        dist.barrier()


class _ProgressReporter:
    """Publishes the last finished minibatch to the job store from a background thread (ten times a second),
    so the training loop never waits on the store."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._value: int | None = None
        self._loss: float | None = None
        self._sent: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def report(self, done: int, force: bool = False, loss: float | None = None) -> None:
        self._value = done
        self._loss = loss
        if force:
            self._push()
        elif self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pipedream-ft-progress", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self._push()

    def close(self) -> None:
        """Stop the thread (before the process group and its store go away)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _push(self) -> None:
        with self._lock:
            value = self._value
            if value is None or value == self._sent:
                return
            try:
                self._store.set("progress", str(value))
                if self._loss is not None:
                    self._store.set("loss", repr(self._loss))
                self._sent = value
            except Exception:  # progress is informational only
                pass


def _mix(seed: int, stage: int, minibatch: int) -> int:
    x = (seed * 1_000_003 + stage) * 1_000_000_007 + minibatch
    return x % (2**63 - 1)


def _ranges(idx: Sequence[int]) -> str:
    out: list[str] = []
    for i in sorted(idx):
        if out and out[-1].endswith(f"-{i - 1}"):
            out[-1] = out[-1].rsplit("-", 1)[0] + f"-{i}"
        elif out and out[-1] == str(i - 1):
            out[-1] = f"{i - 1}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)
