"""The machine profile: costs measured on the machine a plan is for (written by ``pipedream-probe``).

JSON format (``"format": "pipedream-ft-machine"``, ``"version": 1``)::

    {
      "format": "pipedream-ft-machine",
      "version": 1,
      "levels": [                                  # innermost first, like --workers/--bandwidth
        {"workers": 4, "latency_s": 6.1e-05, "bandwidth": 1.9e9,
         "allreduce_latency_s": 8.0e-05, "allreduce_bandwidth": 2.2e9}
      ],
      "overhead_s": 0.00061,                       # the runtime's fixed cost per minibatch per stage
      "stage_overhead_s": [0.0005, 0.0006, 0.0006, 0.0007],
      "cores": 2,                                  # CPU cores per machine (innermost level), or null
      "cpu_parallelism": 1.4,                      # cores the workers really got together, or null
      "samples": {...},                            # the raw measurements (free form, for the record)
      "meta": {...}
    }

Semantics (see :mod:`partitioner.cost` for the formulas that use them):

* ``latency_s`` / ``bandwidth``: one point-to-point transfer of ``o`` bytes between two workers whose
  nearest common level is this one takes ``latency_s + o / bandwidth`` seconds;
* ``allreduce_latency_s`` / ``allreduce_bandwidth``: an all-reduce of ``P`` bytes over ``r`` workers of this
  level takes ``4 (r-1)/r · (allreduce_latency_s + P / allreduce_bandwidth)`` (PipeDream's ring formula
  plus a latency; both fitted to the measured all-reduces, see :func:`fit_allreduce`);
* ``overhead_s``: seconds each stage spends per minibatch in the runtime itself (scheduling, the
  messages' fixed cost, the optimizer step's bookkeeping), outside its layers' compute.

Every measured number must be finite and >= 0 (bandwidths > 0); :class:`MachineError` (a
:class:`~partitioner.plan.PlanError`) names the first that is not. Torch-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .plan import PlanError

__all__ = ["MACHINE_FORMAT", "MACHINE_VERSION", "MachineError", "MachineLevel", "MachineProfile",
           "fit_allreduce", "load_machine", "zero_machine"]

MACHINE_FORMAT = "pipedream-ft-machine"
MACHINE_VERSION = 1


class MachineError(PlanError):
    """A machine profile is malformed or holds a measured cost that is NaN, infinite or negative."""


def _number(value: Any, what: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MachineError(f"machine profile: {what} must be a number, got {value!r}")
    v = float(value)
    if math.isnan(v) or math.isinf(v) or v < 0 or (positive and v == 0):
        need = "> 0" if positive else ">= 0"
        raise MachineError(f"machine profile: measured {what} is {value!r}, it must be finite and {need}; "
                           "the plan is refused (probe the machine again)")
    return v


@dataclass(frozen=True, slots=True)
class MachineLevel:
    """One level of the machine hierarchy (innermost first)."""

    workers: int
    """Workers at this level (e.g. GPUs per node, then nodes): as ``--workers``."""
    latency_s: float
    """One point-to-point transfer's fixed cost, seconds."""
    bandwidth: float
    """Point-to-point bandwidth, bytes per second."""
    allreduce_latency_s: float = 0.0
    """``λ`` of the all-reduce formula ``4 (r-1)/r · (λ + P / B_ar)``, seconds."""
    allreduce_bandwidth: float | None = None
    """``B_ar`` of that formula, bytes per second; None: the point-to-point ``bandwidth``."""

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise MachineError(f"machine profile: workers must be a whole number >= 1, got {self.workers!r}")
        object.__setattr__(self, "latency_s", _number(self.latency_s, "latency_s"))
        object.__setattr__(self, "bandwidth", _number(self.bandwidth, "bandwidth", positive=True))
        object.__setattr__(self, "allreduce_latency_s", _number(self.allreduce_latency_s, "allreduce_latency_s"))
        if self.allreduce_bandwidth is None:
            object.__setattr__(self, "allreduce_bandwidth", self.bandwidth)
        else:
            object.__setattr__(self, "allreduce_bandwidth",
                               _number(self.allreduce_bandwidth, "allreduce_bandwidth", positive=True))

    def to_json(self) -> dict[str, Any]:
        return {"workers": self.workers, "latency_s": self.latency_s, "bandwidth": self.bandwidth,
                "allreduce_latency_s": self.allreduce_latency_s, "allreduce_bandwidth": self.allreduce_bandwidth}


@dataclass(frozen=True, slots=True)
class MachineProfile:
    """What the cost model needs to know about a machine (see the module docstring)."""

    levels: tuple[MachineLevel, ...]
    overhead_s: float = 0.0
    """Fixed cost per minibatch per stage, seconds (the runtime's own work)."""
    stage_overhead_s: tuple[float, ...] = ()
    """That cost as measured on each stage of the probe's pipeline (for the record; the model uses
    ``overhead_s``)."""
    cores: int | None = None
    """CPU cores per machine of the innermost level (None: unknown)."""
    cpu_parallelism: float | None = None
    """Cores the workers of one machine got together when all computed at once (measured: ``W · t_alone /
    t_together``; below ``cores`` when others load the machine). None: use ``cores``."""
    samples: dict[str, Any] = field(default_factory=dict)
    """Raw measurements, free form."""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        levels = tuple(self.levels)
        if not levels:
            raise MachineError("machine profile: at least one level is needed")
        for lv in levels:
            if not isinstance(lv, MachineLevel):
                raise MachineError(f"machine profile: levels must be MachineLevel, got {lv!r}")
        object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "overhead_s", _number(self.overhead_s, "overhead_s"))
        object.__setattr__(self, "stage_overhead_s",
                           tuple(_number(v, f"stage_overhead_s[{i}]") for i, v in enumerate(self.stage_overhead_s)))
        if self.cpu_parallelism is not None:
            object.__setattr__(self, "cpu_parallelism", _number(self.cpu_parallelism, "cpu_parallelism",
                                                                positive=True))
        if self.cores is not None and (isinstance(self.cores, bool) or not isinstance(self.cores, int)
                                       or self.cores < 1):
            raise MachineError(f"machine profile: cores must be a whole number >= 1 or null, got {self.cores!r}")

    # -- views ----------------------------------------------------------------------------------------------

    @property
    def workers(self) -> list[int]:
        return [lv.workers for lv in self.levels]

    @property
    def bandwidth(self) -> list[float]:
        return [lv.bandwidth for lv in self.levels]

    @property
    def world_size(self) -> int:
        return math.prod(self.workers)

    @property
    def effective_cores(self) -> float | None:
        """The cores the contention bound divides by: the measured parallelism, else ``cores``."""
        return self.cpu_parallelism if self.cpu_parallelism is not None else self.cores

    def describe(self) -> str:
        """Lines stating the measured costs, for printing with a plan."""
        out = [f"machine: {' x '.join(map(str, self.workers))} workers"
               + (f", {self.cores} cores per machine" if self.cores else "")
               + (f" ({self.cpu_parallelism:.2f} effective)" if self.cpu_parallelism else "")
               + f"; fixed cost per minibatch per stage {self.overhead_s * 1e3:.3f} ms"]
        for i, lv in enumerate(self.levels):
            out.append(f"  level {i}: transfer {lv.latency_s * 1e6:.1f} us + bytes / {lv.bandwidth:.4g} B/s; "
                       f"all-reduce 4(r-1)/r * ({lv.allreduce_latency_s * 1e6:.1f} us + bytes / "
                       f"{lv.allreduce_bandwidth:.4g} B/s)")
        return "\n".join(out)

    # -- JSON -----------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"format": MACHINE_FORMAT, "version": MACHINE_VERSION,
                "levels": [lv.to_json() for lv in self.levels], "overhead_s": self.overhead_s,
                "stage_overhead_s": list(self.stage_overhead_s), "cores": self.cores,
                "cpu_parallelism": self.cpu_parallelism,
                "samples": self.samples, "meta": self.meta}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, allow_nan=True)

    def save(self, path: str | Path) -> None:
        """Write the JSON (through a temporary file renamed into place)."""
        p = Path(path)
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(self.dumps())
        tmp.replace(p)

    @staticmethod
    def from_json(doc: Any, source: str = "machine profile") -> MachineProfile:
        """Parse and validate; :class:`MachineError` names what is wrong (and ``source``)."""
        try:
            if not isinstance(doc, dict):
                raise MachineError(f"expected a JSON object, got {type(doc).__name__}")
            if doc.get("format") != MACHINE_FORMAT:
                raise MachineError(f"format must be {MACHINE_FORMAT!r}, got {doc.get('format')!r}")
            if doc.get("version") != MACHINE_VERSION:
                raise MachineError(f"unsupported version {doc.get('version')!r} (this build reads {MACHINE_VERSION})")
            raw = doc.get("levels")
            if not isinstance(raw, list):
                raise MachineError(f"levels must be a list, got {raw!r}")
            levels = []
            for i, lv in enumerate(raw):
                if not isinstance(lv, dict):
                    raise MachineError(f"levels[{i}] must be an object, got {lv!r}")
                unknown = set(lv) - set(MachineLevel.__slots__)  # type: ignore[attr-defined]
                if unknown or "workers" not in lv or "latency_s" not in lv or "bandwidth" not in lv:
                    raise MachineError(f"levels[{i}] needs workers, latency_s and bandwidth "
                                       f"(and optionally allreduce_*), got keys {sorted(lv)}")
                levels.append(MachineLevel(**lv))
            stage = doc.get("stage_overhead_s", [])
            if not isinstance(stage, list):
                raise MachineError(f"stage_overhead_s must be a list, got {stage!r}")
            return MachineProfile(tuple(levels), doc.get("overhead_s", 0.0), tuple(stage), doc.get("cores"),
                                  doc.get("cpu_parallelism"), dict(doc.get("samples") or {}),
                                  dict(doc.get("meta") or {}))
        except MachineError as exc:
            msg = str(exc).removeprefix("machine profile: ")
            raise MachineError(f"{source}: {msg}") from None
        except TypeError as exc:
            raise MachineError(f"{source}: {exc}") from None


def load_machine(path: str | Path) -> MachineProfile:
    """Read a machine profile JSON file; :class:`MachineError` on an unreadable or invalid one."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise MachineError(f"cannot read machine profile {str(p)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise MachineError(f"{p}: not a machine profile: not UTF-8 text (byte {exc.start})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MachineError(f"{p}: not JSON ({exc.msg} at line {exc.lineno})") from None
    return MachineProfile.from_json(doc, source=str(p))


def zero_machine(workers: Sequence[int], bandwidth: Sequence[float]) -> MachineProfile:
    """The machine PipeDream's cost model assumes: no latencies, no fixed costs, all-reduce at the link
    bandwidth. Planning with it gives PipeDream's plan."""
    return MachineProfile(tuple(MachineLevel(int(n), 0.0, float(b)) for n, b in zip(workers, bandwidth)))


def fit_allreduce(samples: Sequence[tuple[int, float, float]]) -> tuple[float, float]:
    """Fit ``seconds = 4 (r-1)/r · (λ + bytes / B_ar)`` to ``(replicas, bytes, seconds)`` samples.

    Least squares in ``(λ, 1/B_ar)`` with both kept >= 0 (relative errors weigh the samples equally: each
    row is divided by its measured time). Returns ``(λ, B_ar)``; ``B_ar`` is ``inf`` when the bytes explain
    nothing (then callers keep the point-to-point bandwidth). Needs two samples with ``r >= 2``.
    """
    rows = [(4.0 * (r - 1) / r, 4.0 * (r - 1) / r * b, t) for r, b, t in samples if r >= 2]
    if len(rows) < 2:
        raise MachineError(f"fit_allreduce needs two samples with replicas >= 2, got {list(samples)!r}")
    for _, _, t in rows:
        _number(t, "all-reduce time")
    # weighted normal equations for y = a x1 + c x2, weights 1/t^2
    s11 = s12 = s22 = s1y = s2y = 0.0
    for x1, x2, t in rows:
        w = 1.0 / max(t, 1e-12) ** 2
        s11 += w * x1 * x1
        s12 += w * x1 * x2
        s22 += w * x2 * x2
        s1y += w * x1 * t
        s2y += w * x2 * t
    det = s11 * s22 - s12 * s12
    a = c = -1.0
    if det > 0:
        a = (s1y * s22 - s2y * s12) / det
        c = (s11 * s2y - s12 * s1y) / det
    if a < 0 or c < 0 or det <= 0:  # the unconstrained optimum is outside: best on either edge
        cands = []
        if s11 > 0:
            cands.append((s1y / s11, 0.0))
        if s22 > 0:
            cands.append((0.0, max(s2y / s22, 0.0)))

        def err(p: tuple[float, float]) -> float:
            return sum((p[0] * x1 + p[1] * x2 - t) ** 2 / max(t, 1e-12) ** 2 for x1, x2, t in rows)

        a, c = min(cands, key=err)
        a = max(a, 0.0)
    return a, (1.0 / c if c > 0 else math.inf)
