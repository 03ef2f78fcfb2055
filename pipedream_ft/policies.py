"""When to checkpoint: pluggable, deterministic checkpoint policies and a SIGTERM (preemption) handler.

A policy is asked :meth:`CheckpointPolicy.should_save` once per training step (``step`` = number of updates done,
``now`` = a clock reading such as ``time.monotonic()``). A ``True`` answer means "checkpoint at this step", and
the policy records that a checkpoint was taken then. Measurements (step time, checkpoint costs, failures) are fed
with :meth:`CheckpointPolicy.observe`. Decisions depend only on the arguments given to these methods, so the same
inputs give the same decisions (the pipeline's first stage decides and sends the decision downstream).

**Backpressure.** ``should_save(step, now, busy=True)`` — ``busy`` being ``writer.backlog > 0`` on the committer:
the previous checkpoint is not committed yet — never says yes: a checkpoint that is due is *deferred* to the
first step at which storage has caught up, which stretches the interval instead of queueing saves that would
never commit. The first deferral is logged (WARNING), and so is the stretched interval once that checkpoint is
taken (INFO); later ones go to DEBUG. :attr:`CheckpointPolicy.deferred` counts deferred checkpoints.

**Measured costs.** The runtime feeds, per checkpoint, ``observe(blocking_s=handle.snapshot_s)`` right after
``save`` and ``observe(persist_s=, persist_cpu_s=, commit_s=)`` once the handle is done. :class:`OverheadBudget`
and :class:`YoungDaly` take the cost of a checkpoint to training as ``blocking + background_weight *
persist_cpu`` (the persist thread's CPU time is taken from training when every core is busy:
``background_weight=1``, the default, assumes so) and never checkpoint more often than storage makes a
checkpoint durable (``persist_s + commit_s``).

Built-ins: :class:`EveryNSteps`, :class:`EveryTSeconds`, :class:`YoungDaly`, :class:`OverheadBudget`,
:class:`Never`, and the compositions :class:`AnyOf` / :class:`AllOf`.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from abc import ABC, abstractmethod
from types import FrameType
from typing import Any, Callable, Literal

__all__ = [
    "AllOf",
    "AnyOf",
    "CheckpointPolicy",
    "EveryNSteps",
    "EveryTSeconds",
    "Never",
    "OverheadBudget",
    "PreemptionHandler",
    "YoungDaly",
    "daly_interval",
    "young_interval",
]


log = logging.getLogger(__name__)

_MAX_INTERVAL_STEPS = 2**53
"""Interval used when the budget is unreachable (zero step time): effectively never."""

# ------------------------------------------------------------------------------------------ validation


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_float(name: str, value: Any, *, positive: bool = False, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if not positive and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_now(now: Any) -> float:
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
        raise ValueError(f"now must be a finite number, got {now!r}")
    return float(now)


# ------------------------------------------------------------------------------------------ interface


class CheckpointPolicy(ABC):
    """Decides at which steps to checkpoint.

    Subclasses implement :meth:`decide` (a pure query) and may override :meth:`record_save`, :meth:`observe`
    and :meth:`reset`. :meth:`should_save` = :meth:`decide`, then :meth:`record_save` if the answer is yes.
    """

    def __init__(self) -> None:
        self.last_save_step: int | None = None
        """Step of the last checkpoint recorded (``None`` before the first)."""
        self.last_save_time: float | None = None
        """Clock reading of the last checkpoint recorded, or of :meth:`reset` / the first query."""
        self.deferred: int = 0
        """Checkpoints that were due while ``busy`` and deferred (see :meth:`should_save`)."""
        self._deferring_since: int | None = None

    def should_save(self, step: int, now: float, *, busy: bool = False) -> bool:
        """Whether to checkpoint at ``step`` (clock reading ``now``); a yes is recorded as a checkpoint.

        ``busy``: the previous checkpoint is not finished (not committed) yet; a checkpoint that is due is then
        deferred (counted in :attr:`deferred`, logged once per run of deferrals) and taken at the first step
        that is not busy, whatever :meth:`decide` says then.
        """
        _check_int("step", step, 0)
        now = _check_now(now)
        if self.last_save_time is None:
            self._start_clock(now)
        # a deferred checkpoint stays due (also for policies such as EveryNSteps whose decide() moved on)
        decision = bool(self.decide(step, now)) or self._deferring_since is not None
        if decision and busy:
            if self._deferring_since is None:
                self._deferring_since = step
                self.deferred += 1
                first = self.deferred == 1
                log.log(
                    logging.WARNING if first else logging.DEBUG,
                    "checkpoint due at step %d deferred: the previous checkpoint (step %s) is not committed yet "
                    "(storage slower than the checkpoint interval); the interval is stretched until it is"
                    + ("; later deferrals are logged at DEBUG" if first else ""),
                    step, self.last_save_step,
                )
            return False
        if decision:
            if self._deferring_since is not None:
                log.log(
                    logging.INFO if self.deferred == 1 else logging.DEBUG,
                    "checkpoint at step %d, deferred since step %d: interval stretched to %s steps",
                    step, self._deferring_since,
                    "?" if self.last_save_step is None else step - self.last_save_step,
                )
                self._deferring_since = None
            self.record_save(step, now)
        return decision

    @abstractmethod
    def decide(self, step: int, now: float) -> bool:
        """Whether ``step`` should be checkpointed, without changing any state."""

    def record_save(self, step: int, now: float) -> None:
        """Tell the policy a checkpoint was taken at ``step`` (done by :meth:`should_save`; call it directly
        for checkpoints taken for other reasons, such as an emergency save)."""
        self.last_save_step = step
        self.last_save_time = float(now)

    def observe(
        self,
        *,
        step_time_s: float | None = None,
        checkpoint_cost_s: float | None = None,
        failure: bool = False,
        now: float | None = None,
        blocking_s: float | None = None,
        persist_s: float | None = None,
        persist_cpu_s: float | None = None,
        commit_s: float | None = None,
    ) -> None:
        """Feed measurements (each optional; ignored by policies that do not use them):

        * ``step_time_s``: the duration of a training step;
        * ``blocking_s``: how long a save blocked training (``SaveHandle.snapshot_s``);
          ``checkpoint_cost_s`` is the older name of the same measurement;
        * ``persist_s`` / ``persist_cpu_s``: wall and CPU seconds the background persist of a save took;
        * ``commit_s``: committer: seconds from its part being durable to the commit;
        * ``failure`` (with ``now``): a failure happened at clock reading ``now``.
        """
        for name, value in (("step_time_s", step_time_s), ("checkpoint_cost_s", checkpoint_cost_s),
                            ("blocking_s", blocking_s), ("persist_s", persist_s),
                            ("persist_cpu_s", persist_cpu_s), ("commit_s", commit_s)):
            _check_float(name, value, allow_none=True)
        if now is not None:
            _check_now(now)

    def reset(self, now: float, step: int | None = None) -> None:
        """Start (or restart, after recovery from checkpoint ``step``) counting from clock reading ``now``."""
        self.last_save_time = _check_now(now)
        self.last_save_step = None if step is None else _check_int("step", step, 0)
        self._deferring_since = None

    def _start_clock(self, now: float) -> None:
        self.last_save_time = now

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _CostModel:
    """Measured checkpoint costs: EMAs of the blocking time, the persist CPU time and the time to durability."""

    __slots__ = ("background_weight", "blocking", "persist_cpu", "persist", "commit")

    def __init__(self, alpha: float, background_weight: float) -> None:
        w = _check_float("background_weight", background_weight)
        assert w is not None
        if w > 1:
            raise ValueError(f"background_weight must be in [0, 1], got {background_weight}")
        self.background_weight = w
        self.blocking = _Ema(alpha)
        self.persist_cpu = _Ema(alpha)
        self.persist = _Ema(alpha)
        self.commit = _Ema(alpha)

    def add(self, blocking_s: float | None, persist_s: float | None, persist_cpu_s: float | None,
            commit_s: float | None) -> None:
        for ema, x in ((self.blocking, blocking_s), (self.persist, persist_s), (self.persist_cpu, persist_cpu_s),
                       (self.commit, commit_s)):
            if x is not None:
                ema.add(float(x))

    @property
    def cost(self) -> float | None:
        """Seconds of training lost per checkpoint: blocking + background_weight * persist CPU (None: unknown)."""
        if self.blocking.value is None and self.persist_cpu.value is None:
            return None
        return (self.blocking.value or 0.0) + self.background_weight * (self.persist_cpu.value or 0.0)

    @property
    def latency(self) -> float:
        """Seconds from a save to its checkpoint being durable and committed (0 while unknown)."""
        return (self.persist.value or 0.0) + (self.commit.value or 0.0)


class _Ema:
    """Exponential moving average; the first sample is taken as is."""

    __slots__ = ("alpha", "value")

    def __init__(self, alpha: float) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {alpha!r}")
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value


# ------------------------------------------------------------------------------------------ built-ins


class Never(CheckpointPolicy):
    """Never checkpoint."""

    def decide(self, step: int, now: float) -> bool:
        return False


class EveryNSteps(CheckpointPolicy):
    """Checkpoint at every step that is a positive multiple of ``n`` (aligned across restarts)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = _check_int("n", n, 1)

    def decide(self, step: int, now: float) -> bool:
        return step > 0 and step % self.n == 0

    def __repr__(self) -> str:
        return f"EveryNSteps({self.n})"


class EveryTSeconds(CheckpointPolicy):
    """Checkpoint once at least ``t`` seconds passed since the last checkpoint (or since :meth:`reset`, or the
    first query)."""

    def __init__(self, t: float) -> None:
        super().__init__()
        self.t = _check_float("t", t, positive=True)

    def decide(self, step: int, now: float) -> bool:
        assert self.last_save_time is not None
        return now - self.last_save_time >= self.t

    def __repr__(self) -> str:
        return f"EveryTSeconds({self.t})"


def young_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young's optimal compute time between checkpoints: ``sqrt(2 * delta * M)``."""
    delta = _check_float("checkpoint_cost_s", checkpoint_cost_s)
    m = _check_float("mtbf_s", mtbf_s, positive=True)
    assert delta is not None and m is not None
    return math.sqrt(2.0 * delta * m)


def daly_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimal compute time between checkpoints.

    ``sqrt(2*delta*M) * (1 + sqrt(delta/(2M))/3 + (delta/(2M))/9) - delta`` for ``delta < 2M``, else ``M``.
    """
    delta = _check_float("checkpoint_cost_s", checkpoint_cost_s)
    m = _check_float("mtbf_s", mtbf_s, positive=True)
    assert delta is not None and m is not None
    if delta >= 2.0 * m:
        return m
    x = delta / (2.0 * m)
    return math.sqrt(2.0 * delta * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


class YoungDaly(CheckpointPolicy):
    """Checkpoint at the optimal interval for a given checkpoint cost ``delta`` and mean time between failures
    ``M``: Daly's formula (see :func:`daly_interval`) by default, Young's ``sqrt(2*delta*M)`` with
    ``formula="young"``. A checkpoint is taken once ``now - last checkpoint >= interval``.

    * ``delta``: ``checkpoint_cost_s`` if given, else measured: the EMA of the observed blocking time
      (``blocking_s`` or ``checkpoint_cost_s``) plus ``background_weight`` times the EMA of the observed
      ``persist_cpu_s``.
    * ``M``: ``mtbf_s`` if given, else observed: the time from the first query (or first :meth:`reset`) to the
      latest observed failure, divided by the number of failures observed; unknown until a failure is observed.

    While ``delta`` or ``M`` is unknown the interval is ``fallback_interval_s``. The interval is at least the
    measured time for a checkpoint to become durable (``persist_s + commit_s``: storage must keep up) and is
    clamped to ``[min_interval_s, max_interval_s]``.
    """

    def __init__(
        self,
        mtbf_s: float | None = None,
        checkpoint_cost_s: float | None = None,
        *,
        formula: Literal["daly", "young"] = "daly",
        fallback_interval_s: float = 600.0,
        min_interval_s: float = 0.0,
        max_interval_s: float = math.inf,
        ema_alpha: float = 0.3,
        background_weight: float = 1.0,
    ) -> None:
        super().__init__()
        self.mtbf_s = _check_float("mtbf_s", mtbf_s, positive=True, allow_none=True)
        self.checkpoint_cost_s = _check_float("checkpoint_cost_s", checkpoint_cost_s, allow_none=True)
        if formula not in ("daly", "young"):
            raise ValueError(f"formula must be 'daly' or 'young', got {formula!r}")
        self.formula = formula
        self.fallback_interval_s = _check_float("fallback_interval_s", fallback_interval_s, positive=True)
        if isinstance(min_interval_s, bool) or not isinstance(min_interval_s, (int, float)) or not (
            0 <= min_interval_s < math.inf
        ):
            raise ValueError(f"min_interval_s must be finite and >= 0, got {min_interval_s!r}")
        if isinstance(max_interval_s, bool) or not isinstance(max_interval_s, (int, float)) or not (
            max_interval_s > 0 and max_interval_s >= min_interval_s
        ):
            raise ValueError(
                f"max_interval_s must be > 0 and >= min_interval_s ({min_interval_s}), got {max_interval_s!r}"
            )
        self.min_interval_s = float(min_interval_s)
        self.max_interval_s = float(max_interval_s)
        self.costs = _CostModel(ema_alpha, background_weight)
        """The measured costs (EMAs)."""
        self._failures = 0
        self._origin: float | None = None
        self._last_failure_time: float | None = None

    @property
    def delta(self) -> float | None:
        """Checkpoint cost used (configured, else measured; ``None`` if unknown)."""
        return self.checkpoint_cost_s if self.checkpoint_cost_s is not None else self.costs.cost

    @property
    def mtbf(self) -> float | None:
        """Mean time between failures used (configured, else observed; ``None`` if unknown)."""
        if self.mtbf_s is not None:
            return self.mtbf_s
        if self._failures == 0 or self._origin is None or self._last_failure_time is None:
            return None
        elapsed = self._last_failure_time - self._origin
        return elapsed / self._failures if elapsed > 0 else None

    @property
    def interval_s(self) -> float:
        """Current interval between checkpoints, in seconds."""
        delta, m = self.delta, self.mtbf
        if delta is None or m is None:
            tau = self.fallback_interval_s
        elif self.formula == "young":
            tau = young_interval(delta, m)
        else:
            tau = daly_interval(delta, m)
        return min(max(tau, self.costs.latency, self.min_interval_s), self.max_interval_s)

    def decide(self, step: int, now: float) -> bool:
        assert self.last_save_time is not None
        return now - self.last_save_time >= self.interval_s

    def observe(
        self,
        *,
        step_time_s: float | None = None,
        checkpoint_cost_s: float | None = None,
        failure: bool = False,
        now: float | None = None,
        blocking_s: float | None = None,
        persist_s: float | None = None,
        persist_cpu_s: float | None = None,
        commit_s: float | None = None,
    ) -> None:
        super().observe(step_time_s=step_time_s, checkpoint_cost_s=checkpoint_cost_s, failure=failure, now=now,
                        blocking_s=blocking_s, persist_s=persist_s, persist_cpu_s=persist_cpu_s, commit_s=commit_s)
        self.costs.add(blocking_s if blocking_s is not None else checkpoint_cost_s, persist_s, persist_cpu_s,
                       commit_s)
        if failure:
            if now is None:
                raise ValueError("observe(failure=True) needs now=<clock reading of the failure>, got None")
            if self._origin is None:
                self._origin = float(now)
            self._failures += 1
            self._last_failure_time = float(now)

    def reset(self, now: float, step: int | None = None) -> None:
        super().reset(now, step)
        if self._origin is None:
            self._origin = float(now)

    def _start_clock(self, now: float) -> None:
        super()._start_clock(now)
        if self._origin is None:
            self._origin = now

    def __repr__(self) -> str:
        return f"YoungDaly(mtbf_s={self.mtbf_s}, checkpoint_cost_s={self.checkpoint_cost_s}, formula={self.formula!r})"


class OverheadBudget(CheckpointPolicy):
    """Checkpoint as often as possible while checkpoint cost / compute time between checkpoints <= ``max_fraction``
    (CheckFreq's idea: measure the cost online, keep the overhead under a budget).

    ``cost`` is measured: the EMA of the blocking time (``blocking_s``, or ``checkpoint_cost_s``) plus
    ``background_weight`` times the EMA of the persist thread's CPU time (``persist_cpu_s``); ``step_time`` is the
    EMA of ``step_time_s``. The interval in steps is the larger of ``ceil(cost / (max_fraction * step_time))``
    and ``ceil((persist_s + commit_s) / step_time)`` (storage must make each checkpoint durable before the next),
    clamped to ``[min_interval_steps, max_interval_steps]``; ``initial_interval_steps`` until a cost and a step
    time have been observed. A checkpoint is taken once ``step - last checkpoint step >= interval`` (the last
    checkpoint step is 0 before the first one, or the step given to :meth:`reset`).
    """

    def __init__(
        self,
        max_fraction: float = 0.01,
        *,
        initial_interval_steps: int = 100,
        min_interval_steps: int = 1,
        max_interval_steps: int | None = None,
        ema_alpha: float = 0.3,
        background_weight: float = 1.0,
    ) -> None:
        super().__init__()
        frac = _check_float("max_fraction", max_fraction, positive=True)
        assert frac is not None
        if frac > 1:
            raise ValueError(f"max_fraction must be in (0, 1], got {max_fraction}")
        self.max_fraction = frac
        self.initial_interval_steps = _check_int("initial_interval_steps", initial_interval_steps, 1)
        self.min_interval_steps = _check_int("min_interval_steps", min_interval_steps, 1)
        if max_interval_steps is not None:
            _check_int("max_interval_steps", max_interval_steps, min_interval_steps)
        self.max_interval_steps = max_interval_steps
        self.costs = _CostModel(ema_alpha, background_weight)
        """The measured costs (EMAs)."""
        self._step_time = _Ema(ema_alpha)

    @property
    def interval_steps(self) -> int:
        """Current interval between checkpoints, in steps."""
        cost, step_time = self.costs.cost, self._step_time.value
        if cost is None or step_time is None:
            n = self.initial_interval_steps
        else:
            n = max(self._steps(cost, self.max_fraction * step_time), self._steps(self.costs.latency, step_time))
        n = max(n, self.min_interval_steps)
        if self.max_interval_steps is not None:
            n = min(n, self.max_interval_steps)
        return n

    @staticmethod
    def _steps(seconds: float, per_step: float) -> int:
        ratio = seconds / per_step if per_step > 0 else (0.0 if seconds == 0 else math.inf)
        # Small epsilon so that float noise (e.g. 0.1/(0.01*0.1) = 100.00000000000001) does not add a step.
        return math.ceil(ratio - 1e-9) if ratio < _MAX_INTERVAL_STEPS else _MAX_INTERVAL_STEPS

    def decide(self, step: int, now: float) -> bool:
        last = self.last_save_step if self.last_save_step is not None else 0
        return step - last >= self.interval_steps

    def observe(
        self,
        *,
        step_time_s: float | None = None,
        checkpoint_cost_s: float | None = None,
        failure: bool = False,
        now: float | None = None,
        blocking_s: float | None = None,
        persist_s: float | None = None,
        persist_cpu_s: float | None = None,
        commit_s: float | None = None,
    ) -> None:
        super().observe(step_time_s=step_time_s, checkpoint_cost_s=checkpoint_cost_s, failure=failure, now=now,
                        blocking_s=blocking_s, persist_s=persist_s, persist_cpu_s=persist_cpu_s, commit_s=commit_s)
        if step_time_s is not None:
            self._step_time.add(float(step_time_s))
        self.costs.add(blocking_s if blocking_s is not None else checkpoint_cost_s, persist_s, persist_cpu_s,
                       commit_s)

    def __repr__(self) -> str:
        return f"OverheadBudget(max_fraction={self.max_fraction})"


class _Composite(CheckpointPolicy):
    def __init__(self, *policies: CheckpointPolicy) -> None:
        super().__init__()
        if not policies:
            raise ValueError(f"{type(self).__name__} needs at least one policy, got none")
        for i, p in enumerate(policies):
            if not isinstance(p, CheckpointPolicy):
                raise TypeError(f"policy {i} must be a CheckpointPolicy, got {type(p).__name__}")
        self.policies: tuple[CheckpointPolicy, ...] = tuple(policies)

    def _start_clock(self, now: float) -> None:
        super()._start_clock(now)
        for p in self.policies:
            if p.last_save_time is None:
                p._start_clock(now)

    def record_save(self, step: int, now: float) -> None:
        super().record_save(step, now)
        for p in self.policies:
            p.record_save(step, now)

    def observe(
        self,
        *,
        step_time_s: float | None = None,
        checkpoint_cost_s: float | None = None,
        failure: bool = False,
        now: float | None = None,
        blocking_s: float | None = None,
        persist_s: float | None = None,
        persist_cpu_s: float | None = None,
        commit_s: float | None = None,
    ) -> None:
        for p in self.policies:
            p.observe(step_time_s=step_time_s, checkpoint_cost_s=checkpoint_cost_s, failure=failure, now=now,
                      blocking_s=blocking_s, persist_s=persist_s, persist_cpu_s=persist_cpu_s, commit_s=commit_s)

    def reset(self, now: float, step: int | None = None) -> None:
        super().reset(now, step)
        for p in self.policies:
            p.reset(now, step)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self.policies))})"


class AnyOf(_Composite):
    """Checkpoint when any of the policies says so; every policy then records the checkpoint."""

    def decide(self, step: int, now: float) -> bool:
        return any([p.decide(step, now) for p in self.policies])


class AllOf(_Composite):
    """Checkpoint when all of the policies say so; every policy then records the checkpoint."""

    def decide(self, step: int, now: float) -> bool:
        return all([p.decide(step, now) for p in self.policies])


# ------------------------------------------------------------------------------------------ preemption


_INSTALLED: list[PreemptionHandler] = []
"""The handlers installed in this process, the newest last."""


class PreemptionHandler:
    """Turns SIGTERM (by default) into a flag, so that training can take an emergency checkpoint.

    The signal handler only records that (and when) the signal arrived; the training loop checks
    :attr:`requested` and uses :meth:`fits` to decide whether an emergency save can finish within the grace
    period (e.g. Kubernetes' ``terminationGracePeriodSeconds``, 30 s by default). :meth:`install` must be
    called from the main thread; :meth:`uninstall` restores the previous handlers. Also a context manager.
    """

    def __init__(
        self,
        grace_s: float = 30.0,
        *,
        signals: tuple[int, ...] = (signal.SIGTERM,),
        margin_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        g = _check_float("grace_s", grace_s, positive=True)
        m = _check_float("margin_s", margin_s)
        assert g is not None and m is not None
        if m >= g:
            raise ValueError(f"margin_s must be < grace_s ({g}), got {m}")
        if not signals:
            raise ValueError("signals must be non-empty, got ()")
        self.grace_s = g
        self.margin_s = m
        self.signals = tuple(signals)
        self._clock = clock
        self._previous: dict[int, Any] = {}
        self._requested_at: float | None = None
        self._signum: int | None = None

    def install(self) -> PreemptionHandler:
        """Install the handler; returns ``self``. ``ValueError`` outside the main thread (like ``signal.signal``)."""
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(  # the same type signal.signal() raises outside the main thread
                f"PreemptionHandler.install() must be called from the main thread, "
                f"not {threading.current_thread().name!r}"
            )
        if self._previous:
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        _INSTALLED.append(self)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were installed before :meth:`install`."""
        previous, self._previous = self._previous, {}
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        if self in _INSTALLED:
            _INSTALLED.remove(self)

    @staticmethod
    def of_process() -> PreemptionHandler | None:
        """The handler installed last in this process and still installed: what a trainer built on a thread other
        than the main one, which cannot install one, watches."""
        return _INSTALLED[-1] if _INSTALLED else None

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._requested_at is None:
            self._requested_at = self._clock()
            self._signum = signum

    @property
    def requested(self) -> bool:
        """Whether the signal arrived."""
        return self._requested_at is not None

    @property
    def requested_at(self) -> float | None:
        """Clock reading when the signal first arrived."""
        return self._requested_at

    @property
    def signum(self) -> int | None:
        """Which signal arrived first."""
        return self._signum

    def remaining_s(self, now: float | None = None) -> float:
        """Grace time left (minus the margin): the whole grace period if no signal arrived yet."""
        if self._requested_at is None:
            return self.grace_s - self.margin_s
        now = self._clock() if now is None else now
        return self.grace_s - self.margin_s - (now - self._requested_at)

    def fits(self, estimated_save_s: float, now: float | None = None) -> bool:
        """Whether a save taking ``estimated_save_s`` seconds finishes within the remaining grace time."""
        est = _check_float("estimated_save_s", estimated_save_s)
        assert est is not None
        return est <= self.remaining_s(now)

    def clear(self) -> None:
        """Forget a received signal."""
        self._requested_at = None
        self._signum = None

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
