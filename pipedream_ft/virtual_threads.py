"""Virtual stages with fault tolerance: each stage of a process on a thread of its own, as a logical rank.

:class:`~pipedream_ft.virtual.VirtualTrainer` runs a process's stages on its one rank and one thread. A job that
checkpoints, recovers in place or re-plans from measured costs under these schedules still runs here, until
those paths run per process: each stage is a whole :class:`~pipedream_ft.trainer.PipelineTrainer` on a thread of
its own, a *logical rank* of a job of ``S = v W`` ranks (process ``w``'s ``k``-th stage is logical rank
``w v + k``) with its own process groups, checkpoint parts, cuts and in-place recovery; a process that dies
takes its logical ranks with it, and its replacement brings them back. The stages of a process take their
actions one at a time in the order the schedule gives the process
(:class:`~pipedream_ft.pipeline.turns.Turns`). Under NCCL two logical ranks on one GPU cannot share a
communicator, so a layout whose neighbouring stages share a process (the V schedules) needs gloo here.
"""

from __future__ import annotations

import copy
import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from partitioner.plan import Plan, PlanError

from .config import PipelineConfig, TrainResult, planned_schedule
from .checkpoint import Storage
from .env import DistEnv, read_env
from .ft.checkpointer import CheckpointConfig
from .ft.coordination import Coordinator
from .policies import PreemptionHandler
from .ft.elastic import replan_for_world
from .pipeline.connection import backend_and_device
from .pipeline.executor import RankStats
from .pipeline.group import PeerTimeoutError
from .pipeline.turns import Turns
from .schedules.window import WindowSchedule, resolve_schedule
from .virtual import merged_stats, runs_virtual, stages_per_process, virtual_layout

__all__ = ["ThreadedStages"]

def _check_backend(layout: WindowSchedule, backend: str) -> None:
    """Under NCCL, refuse a layout whose neighbouring stages, or first and last stage (the targets' link, tied
    embeddings), share a process: NCCL cannot connect two ranks on one GPU."""
    if backend != "nccl":
        return
    where = layout.placement
    pairs = [(s, s + 1) for s in range(len(where) - 1)] + [(0, len(where) - 1)]
    shared = [(a, b) for a, b in pairs if where[a] == where[b]]
    if shared:
        a, b = shared[0]
        raise PlanError(f"the schedule {layout} puts stages {a} and {b}, which exchange tensors, on process "
                        f"{where[a]}: NCCL cannot connect two ranks on one GPU; train it with "
                        "PipelineConfig(backend='gloo'), or with interleaved 1F1B on 2 or more processes")


def _logical_plan(plan: Plan, layout: WindowSchedule) -> Plan:
    """``plan`` with each stage on its logical rank (process ``w``'s ``k``-th stage: ``w v + k``)."""
    v = layout.num_stages // layout.num_ranks
    replicated = [s.index for s in plan.stages if s.replicas != 1]
    if replicated:
        raise PlanError(f"virtual stages run a straight pipeline; the plan replicates stages {replicated}")
    ranks = {s: w * v + layout.stages_of(w).index(s) for s, w in enumerate(layout.placement)}
    stages = tuple(dataclasses.replace(s, ranks=(ranks[s.index],)) for s in plan.stages)
    return dataclasses.replace(plan, stages=stages)


class _StageThread:
    """One stage's thread: builds its trainer, then runs what it is given, one call at a time."""

    def __init__(self, name: str) -> None:
        self._calls: queue.Queue[tuple[Callable[[], Any], queue.Queue[tuple[bool, Any]]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            fn, reply = item
            del item
            try:
                result: tuple[bool, Any] = (True, fn())
            except BaseException as exc:  # handed to the caller's thread
                result = (False, exc)
            del fn  # nothing of the call (a whole model, for the first) outlives it here
            reply.put(result)
            del result, reply

    def submit(self, fn: Callable[[], Any]) -> queue.Queue[tuple[bool, Any]]:
        reply: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._calls.put((fn, reply))
        return reply

    def stop(self) -> None:
        self._calls.put(None)


class ThreadedStages:
    """This process's stages of a plan of virtual stages, one thread each (see the module docstring); made by
    :class:`~pipedream_ft.trainer.PipelineTrainer` for a fault-tolerant job whose schedule gives a process several
    stages, with its arguments."""

    def __init__(self, model: nn.Module | Callable[[], nn.Module], plan: Plan, *,
                 config: PipelineConfig | None = None, env: DistEnv | None = None, **kwargs: Any) -> None:
        from .trainer import PipelineTrainer

        self.config = config = config or PipelineConfig()
        self.env = env = env or read_env()
        schedule = resolve_schedule(planned_schedule(config.schedule, plan.settings))
        if not runs_virtual(schedule):
            raise PlanError(f"the schedule {schedule} runs one stage per process")
        if config.replan is not None:
            raise PlanError("re-planning from measured costs (PipelineConfig(replan=...)) does not run with virtual "
                            "stages: a process's stages would each measure and re-plan alone; leave replan=None "
                            "(a resize still re-plans)")
        stages = env.world_size * stages_per_process(schedule, plan, env.world_size)
        profile, checkpoint = kwargs.get("profile"), kwargs.get("checkpoint")
        url = checkpoint.url if checkpoint is not None else None
        if plan.num_stages != stages and (profile is not None or url is not None) and isinstance(schedule, str):
            # the job runs on another number of processes than the plan was made for: plan as many stages again
            plan = replan_for_world(plan, profile, stages, rank=env.rank,
                                    storage=Storage(url, checkpoint.storage_options) if url is not None else None)
        layout = virtual_layout(schedule, plan, env.world_size, config.flush_every)
        assert layout is not None
        _check_backend(layout, backend_and_device(env.local_rank, config.backend)[0])
        self.layout = layout
        self.plan = plan
        self.stage_indices = layout.stages_of(env.rank)
        """The stages this process holds, in order."""
        v = len(self.stage_indices)
        logical = _logical_plan(plan, layout)
        if not isinstance(model, nn.Module):
            model = model()
        copies = [model] + [copy.deepcopy(model) for _ in range(v - 1)]  # one per stage: each keeps its layers
        sub_config = dataclasses.replace(config, schedule=layout)
        ckpt = checkpoint if checkpoint is not None else CheckpointConfig() if env.recovery == "in-place" else None
        self._preemption = PreemptionHandler(grace_s=ckpt.grace_s).install() \
            if ckpt is not None and ckpt.emergency_save and threading.current_thread() is threading.main_thread() \
            else None
        """SIGTERM's handler: the stages' threads cannot install one, so the process's main thread does it for them
        (an emergency checkpoint of every stage, see :class:`~pipedream_ft.policies.PreemptionHandler`)."""
        if env.supervisor is not None:  # in-place recovery: the supervisor watches and replaces these ranks
            Coordinator(env, config.timeout_s).publish_logical_ranks([env.rank * v + k for k in range(v)])
        self.turns = Turns(layout, env.rank, config.timeout_s)
        self._threads = [_StageThread(f"pipedream-ft-stage-{s}") for s in self.stage_indices]

        def build(k: int, whole: nn.Module) -> Callable[[], PipelineTrainer]:
            sub_env = dataclasses.replace(env, rank=env.rank * v + k, world_size=env.world_size * v,
                                          local_world_size=env.local_world_size * v)
            return lambda: PipelineTrainer(whole, logical, config=sub_config, env=sub_env, turns=self.turns, **kwargs)

        calls = [build(k, m) for k, m in enumerate(copies)]
        del copies, model  # each stage's trainer keeps its own layers only
        try:
            self.trainers: list[PipelineTrainer] = self._all(calls, building=True)
            """One trainer per stage of this process, in stage order."""
        except BaseException:
            self._stop()
            raise
        del calls

    # -- running on every stage -------------------------------------------------------------------------------

    def _all(self, calls: Sequence[Callable[[], Any]], *, building: bool = False) -> list[Any]:
        """Run ``calls[k]`` on stage ``k``'s thread, all at once (they are collectives of the logical ranks);
        return their results. When one fails, the others' groups are released so that none waits for it, and
        the root cause is raised: the first error that is not a peer's failure seen from another stage. While
        ``building`` the trainers (there are no groups to release yet), the first error is raised at once."""
        replies = [t.submit(c) for t, c in zip(self._threads, calls)]
        results: list[Any] = [None] * len(replies)
        errors: list[BaseException] = []
        pending = list(range(len(replies)))
        while pending:
            for k in list(pending):
                try:
                    ok, value = replies[k].get_nowait()
                except queue.Empty:
                    continue
                pending.remove(k)
                if ok:
                    results[k] = value
                else:
                    if building:
                        raise value
                    errors.append(value)
                    if len(errors) == 1:
                        self._release_all()
            if pending:
                time.sleep(0.01)
        if errors:
            causes = [e for e in errors if not isinstance(e, PeerTimeoutError)] or errors
            raise causes[0]
        return results

    def _release_all(self) -> None:
        for t in self.trainers:
            try:
                t.release()
            except Exception:  # the first error is what the caller sees
                pass

    def _stop(self) -> None:
        """End the stages' threads (after their last call) and give SIGTERM back its previous handler."""
        for t in self._threads:
            t.stop()
        if self._preemption is not None:
            self._preemption.uninstall()
            self._preemption = None

    def _each(self, fn: Callable[[Any], Any]) -> list[Any]:
        return self._all([(lambda t=t: fn(t)) for t in self.trainers])

    # -- the trainer's methods --------------------------------------------------------------------------------

    def preflight(self, data: Any) -> None:
        self._each(lambda t: t.preflight(data))

    def train(self, data: Any, steps: int) -> TrainResult:
        return self._merged(self._each(lambda t: t.train(data, steps)))

    def fit(self, data: Any, total: int) -> TrainResult:
        return self._merged(self._each(lambda t: t.fit(data, total)))

    def evaluate(self, data: Any, steps: int, metric_fn: Any = None) -> Any:
        return self._each(lambda t: t.evaluate(data, steps, metric_fn))[0]

    def gather_stats(self) -> list[dict[str, Any]]:
        return self._each(lambda t: t.gather_stats())[0]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self._each(lambda t: t.full_state_dict())[0]

    def save_model(self, path: str, format: str = "torch") -> None:
        self._each(lambda t: t.save_model(path, format))

    def save_pretrained(self, directory: str, max_shard_bytes: int = 5 * 10**9) -> None:
        self._each(lambda t: t.save_pretrained(directory, max_shard_bytes))

    def close(self) -> None:
        try:
            self._each(lambda t: t.close())
        finally:
            self._stop()

    def release(self) -> None:
        for t in self.trainers:
            t.release()

    # -- views ------------------------------------------------------------------------------------------------

    @property
    def position(self) -> int:
        return self.trainers[0].position

    @property
    def resumed_from(self) -> int | None:
        return self.trainers[0].resumed_from

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        return self.plan.num_stages - 1 in self.stage_indices

    @property
    def stats(self) -> RankStats:
        return merged_stats([t.stats for t in self.trainers])

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        return self.trainers[0].recoveries

    @property
    def timeline(self) -> dict[str, float]:
        return self.trainers[0].timeline

    def _merged(self, results: list[TrainResult]) -> TrainResult:
        first = results[0]
        return dataclasses.replace(first, stats=merged_stats([r.stats for r in results]))
