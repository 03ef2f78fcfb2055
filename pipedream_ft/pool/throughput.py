"""A model's speed on ``n`` workers: the partitioner's predicted time per minibatch of its best plan.

Each (model, n) is planned once: the curve is kept in memory and on disk (``cache_dir/<key>.json``, the key a
hash of the profile file's bytes and the planning settings), so a second run plans nothing. A size where no plan
exists (a straight pipeline longer than the model's cut points, or a ``memory_bytes`` limit no plan fits) is
recorded as None and never allowed.

Planning a size takes milliseconds to a second for most PipeDream profiles; a model whose search has very many
antichain states (e.g. gnmt_large: 8,890, against at most 430 for the ResNets, DenseNet-121, VGG and GNMT) takes
seconds to a minute per size, so elastic policies are offered only the powers of two (and the job's own sizes)
for it: see :meth:`ThroughputModel.elastic_sizes`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .errors import PoolError

__all__ = ["PlanSettings", "ThroughputModel", "default_cache_dir"]


def default_cache_dir() -> Path:
    """``$PIPEDREAM_POOL_CACHE``, else ``$XDG_CACHE_HOME/pipedream-pool`` (``~/.cache/pipedream-pool``)."""
    env = os.environ.get("PIPEDREAM_POOL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pipedream-pool"


@dataclass(frozen=True)
class PlanSettings:
    """How each size is planned: one level at ``bandwidth`` bytes/s, or ``machine_size`` devices per machine
    (two levels: ``bandwidth`` inside a machine, ``inter_bandwidth`` between machines, for sizes that are a
    multiple of it); ``straight`` and ``memory_bytes`` as the partitioner takes them."""

    bandwidth: float = 1.25e9
    straight: bool = False
    memory_bytes: float | None = None
    machine_size: int | None = None
    inter_bandwidth: float | None = None

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise PoolError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if self.memory_bytes is not None and not self.memory_bytes > 0:
            raise PoolError(f"memory_bytes must be > 0, got {self.memory_bytes}")
        if self.machine_size is not None and self.machine_size < 1:
            raise PoolError(f"machine_size must be >= 1, got {self.machine_size}")

    def key(self) -> str:
        return json.dumps([self.bandwidth, self.straight, self.memory_bytes, self.machine_size,
                           self.inter_bandwidth])


class ThroughputModel:
    """Minibatches per second of each model (a profile file) on ``n`` workers, planned lazily and cached."""

    def __init__(self, profiles: dict[str, Path], settings: PlanSettings | None = None,
                 cache_dir: Path | None = None, dense_states: int = 2000) -> None:
        self.dense_states = dense_states
        self.profiles = dict(profiles)
        self.settings = settings or PlanSettings()
        self.cache_dir = cache_dir
        self._times: dict[str, dict[int, float | None]] = {}
        self._keys: dict[str, str] = {}
        self._loaded: dict[str, object] = {}
        self._problems: dict[str, tuple[object, object, float] | None] = {}
        self._contractions: dict[str, object] = {}
        self._states: dict[str, int] = {}
        self.planned = 0
        """How many (model, n) this object planned (not found in a cache)."""

    def _key(self, model: str) -> str:
        if model not in self._keys:
            try:
                data = self.profiles[model].read_bytes()
            except KeyError:
                raise PoolError(f"unknown model {model!r}") from None
            except OSError as exc:
                raise PoolError(f"model {model!r}: cannot read {self.profiles[model]}: {exc.strerror}") from None
            h = hashlib.sha256(data)
            h.update(self.settings.key().encode())
            self._keys[model] = h.hexdigest()[:32]
        return self._keys[model]

    def _cache_file(self, model: str) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / f"{self._key(model)}.json"

    def _load(self, model: str) -> dict[int, float | None]:
        if model not in self._times:
            times: dict[int, float | None] = {}
            path = self._cache_file(model)
            if path is not None and path.exists():
                try:
                    data = json.loads(path.read_text())
                    times = {int(k): (None if v is None else float(v)) for k, v in data["times"].items()}
                    if data.get("states") is not None:
                        self._states[model] = int(data["states"])
                except (OSError, ValueError, AttributeError, KeyError, TypeError):
                    times = {}  # a damaged or older cache is re-planned
            self._times[model] = times
        return self._times[model]

    def _profile(self, model: str) -> object:
        if model not in self._loaded:
            from profiler.profile import ProfileError, load_profile

            try:
                self._loaded[model] = load_profile(self.profiles[model])
            except ProfileError as exc:
                raise PoolError(f"model {model!r}: {exc}") from None
        return self._loaded[model]

    def _contracted(self, model: str) -> object:
        if model not in self._contractions:
            from partitioner.contract import contract

            self._contractions[model] = contract(self._profile(model))  # type: ignore[arg-type]
        return self._contractions[model]

    def _single_level(self, model: str) -> tuple[object, object, float] | None:
        """The model's one-level problem, built once (the costly part of planning: the antichain states and
        every range's times do not depend on the worker count); None where there is nothing to plan."""
        if model not in self._problems:
            from partitioner.antichain import linearize
            from partitioner.optimizer import flat_problem

            s = self.settings
            states = linearize(self._contracted(model).profile)  # type: ignore[attr-defined]
            self._states[model] = int(states.num_states)
            self._problems[model] = None if states.num_states == 0 else (
                states, flat_problem(states, 1, s.bandwidth, s.straight, s.memory_bytes),
                float(states.compute_s[-1]))
        return self._problems[model]

    def _plan_time(self, model: str, n: int) -> float | None:
        from partitioner.optimizer import partition
        from partitioner.plan import PlanError

        s = self.settings
        if s.machine_size is not None and n > s.machine_size and n % s.machine_size == 0:
            try:
                plan = partition(self._profile(model), [s.machine_size, n // s.machine_size],  # type: ignore
                                 [s.bandwidth, s.inter_bandwidth or s.bandwidth], straight=s.straight)
            except PlanError:
                return None
            return plan.time_per_minibatch_s if plan.time_per_minibatch_s > 0 else None
        # one level: what partition() does, with what does not depend on the worker count done once per model:
        # its scalable search for chains, else its general search on a problem built once
        from dataclasses import replace

        from partitioner.chain import flat_upper_plan, plan_chain
        from partitioner.optimizer import solve_level

        if s.memory_bytes is None:
            try:
                fast = plan_chain(self._profile(model), self._contracted(model), [n], [s.bandwidth],  # type: ignore
                                  s.straight)
            except PlanError:
                return None
            if fast is not None:
                return fast.time_per_minibatch_s if fast.time_per_minibatch_s > 0 else None
        built = self._single_level(model)
        if built is None:  # nothing but inputs
            return None
        states, prob, compute = built
        upper = flat_upper_plan(states, n, s.bandwidth, s.straight) if s.memory_bytes is None else None
        sol = solve_level(replace(prob, workers=n), compute / n, upper)  # type: ignore[type-var]
        return sol.time_s if sol is not None and sol.time_s > 0 else None

    def num_states(self, model: str) -> int:
        """How many antichain states the model's search has (from the cache where it is there)."""
        self._load(model)
        if model not in self._states:
            self._single_level(model)
        return self._states[model]

    def elastic_sizes(self, model: str, lo: int, hi: int) -> list[int]:
        """The sizes from ``lo`` to ``hi`` offered to elastic policies: every one, or, for a model whose search
        has more than ``dense_states`` antichain states (planning each size then takes seconds to minutes),
        ``lo``, ``hi`` and the powers of two between."""
        if hi < lo:
            return []
        if self.num_states(model) <= self.dense_states:
            return list(range(lo, hi + 1))
        return sorted({lo, hi} | {1 << k for k in range(hi.bit_length()) if lo <= 1 << k <= hi})

    def ensure(self, model: str, sizes: Iterable[int]) -> None:
        """Plan every size of ``sizes`` not known yet for ``model``, and write the cache once."""
        if model not in self.profiles:
            raise PoolError(f"unknown model {model!r} (known: {', '.join(sorted(self.profiles)) or 'none'})")
        times = self._load(model)
        missing = sorted({int(n) for n in sizes} - set(times))
        if not missing:
            return
        for n in missing:
            if n < 1:
                raise PoolError(f"model {model!r}: worker count must be >= 1, got {n}")
            times[n] = self._plan_time(model, n)
            self.planned += 1
        path = self._cache_file(model)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
                with os.fdopen(fd, "w") as f:
                    json.dump({"states": self._states.get(model),
                               "times": {str(k): v for k, v in sorted(times.items())}}, f)
                os.replace(tmp, path)
            except OSError:
                pass  # an unwritable cache only costs time

    def time_per_minibatch(self, model: str, n: int) -> float | None:
        """Seconds per minibatch of the best plan on ``n`` workers; None where no plan exists."""
        self.ensure(model, [n])
        return self._times[model][n]

    def rate(self, model: str, n: int) -> float | None:
        """Minibatches per second on ``n`` workers; None where no plan exists."""
        t = self.time_per_minibatch(model, n)
        return None if t is None else 1.0 / t

    def curve(self, model: str, sizes: Iterable[int]) -> dict[int, float]:
        """``{n: minibatches/s}`` over ``sizes``, leaving out sizes where no plan exists."""
        sizes = list(sizes)
        self.ensure(model, sizes)
        times = self._times[model]
        return {n: 1.0 / times[n] for n in sizes if times[n] is not None}  # type: ignore[operator]
