"""Re-planning, driven while training (see :mod:`pipedream_ft.ft.replan` for the decision itself).

Every rank's :class:`Measure` hook publishes its stage's compute time per minibatch to the job's store every
``policy.every`` minibatches; on rank 0 the checkpointer asks :meth:`RePlanControl.due` at each of stage 0's
possible cuts whether to stop there for a better plan, which it stores beside the checkpoints first.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Iterable, Sequence

from partitioner.plan import Plan, PlanError
from profiler.profile import Profile

from ..errors import say
from ..pipeline.executor import RankStats
from ..pipeline.hooks import Hooks
from .elastic import describe_plan
from .replan import Measurement, RePlanPolicy, consider, processes_of, store_replanned

__all__ = ["Measure", "RePlanControl"]

log = logging.getLogger(__name__)


class Measure(Hooks):
    """Publishes this stage's compute time per minibatch (forward + backward) every ``policy.every`` minibatches,
    measured since the previous publication (the first after ``policy.after`` minibatches)."""

    def __init__(self, policy: RePlanPolicy, stats: Callable[[], RankStats], stage: int,
                 publish: Callable[[str], None]) -> None:
        self.policy = policy
        self.stats = stats
        self.stage = stage
        self.publish = publish
        self._mark: tuple[float, int] | None = None

    def on_update(self, round_: int, done: int, start: float, end: float) -> None:
        s = self.stats()
        compute = s.forward_s + s.backward_s
        if done < self.policy.after:
            return
        if self._mark is None:
            self._mark = (compute, s.minibatches)
            return
        seconds, count = compute - self._mark[0], s.minibatches - self._mark[1]
        if count >= self.policy.every:
            self._mark = (compute, s.minibatches)
            try:
                self.publish(Measurement(self.stage, seconds / count, count).to_json())
            except Exception:  # measuring must not stop training
                pass


class RePlanControl:
    """Rank 0's decisions: at a possible cut, is a re-plan due (see :meth:`due`)."""

    def __init__(self, policy: RePlanPolicy, *, plan: Plan, profile: Profile, key: str, world_size: int,
                 coordinator: Any, storage: Any, slots: Iterable[int] | None = None,
                 placement: Sequence[int] | None = None) -> None:
        """``world_size``: the workers the new plan is for (with several stages per process: the stages);
        ``slots``: where the stages' measurements are filed (``None``: under each rank); ``placement``: with
        several stages per process, the process of each stage (the layout's), so that plans are predicted per
        process (``None``: one stage per process, or where the plan's recorded schedule places them)."""
        self.policy = policy
        self.plan = plan
        self.profile = profile
        self.key = key
        """The current plan's hash: measurements and stored re-plans are filed under it."""
        self.world_size = world_size
        self.coordinator = coordinator
        self.storage = storage
        self.slots = list(slots) if slots is not None else None
        self.placement = list(placement) if placement is not None else None
        self.replans = 0

    def due(self, cut: int) -> bool:
        """At stage 0's possible cut ``cut``: stop here for a better plan? (It is stored before saying yes.)"""
        policy = self.policy
        if cut < policy.after + policy.every or cut % policy.every or self.replans >= policy.max_replans:
            return False
        per_stage: dict[int, list[float]] = {}
        for text in self.coordinator.measurements(self.key, self.slots).values():
            m = Measurement.from_json(text)
            per_stage.setdefault(m.stage, []).append(m.compute_s)
        if len(per_stage) < self.plan.num_stages:
            return False
        measured = {s: sum(v) / len(v) for s, v in per_stage.items()}
        try:
            found = consider(self.profile, self.plan, measured, self.world_size, policy.min_gain, self.placement)
        except PlanError as exc:  # measured costs that make no sense: keep the plan, keep training
            log.warning("not re-planning: %s", exc)
            return False
        if found is None:
            return False
        new, gain = found
        store_replanned(self.storage, self.plan, new, self.key)
        self.replans += 1
        where = processes_of(self.plan, self.placement)
        busy = "" if where is None else " (per process: " + ", ".join(
            f"{sum(measured[s] for s in measured if where[s] == p) * 1000:.1f}" for p in sorted(set(where))) + ")"
        msg = (f"re-planning at minibatch {cut}: measured stage times "
               f"{', '.join(f'{measured[s] * 1000:.1f}' for s in sorted(measured))}{busy} ms per minibatch; "
               f"{describe_plan(self.plan)} -> {describe_plan(new)}, predicted {gain:.0%} faster")
        log.warning(msg)
        say(f"pipedream-ft: {msg}", sys.stdout)
        return True
