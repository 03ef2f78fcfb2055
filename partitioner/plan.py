"""The plan: which layers form each pipeline stage and which ranks run it.

JSON format (``"format": "pipedream-ft-plan"``, ``"version": 1``)::

    {
      "format": "pipedream-ft-plan",
      "version": 1,
      "profile_hash": "<Profile.structure_hash()>",
      "num_layers": 22,
      "layer_names": ["0", "1", ...],
      "workers": 4,
      "stages": [
        {"index": 0, "layers": [0, 1, ..., 9], "replicas": 2, "ranks": [0, 1], "time_s": 0.0123},
        {"index": 1, "layers": [10, ..., 21], "replicas": 2, "ranks": [2, 3], "time_s": 0.0119}
      ],
      "layer_to_stage": [0, 0, ..., 1],
      "stage_to_ranks": [[0, 1], [2, 3]],
      "time_per_minibatch_s": 0.0123,
      "data_parallel_time_s": 0.0201,
      "speedup_over_data_parallel": 1.63,
      "settings": {"workers": [4], "bandwidth": [1e9], "straight": false, "memory_bytes": null},
      "recompute": [3, 4, 7]
    }

``time_s`` of a stage is its predicted time per minibatch (compute divided among its replicas, plus their
weight all-reduce); ``time_per_minibatch_s`` is the pipeline's, i.e. that of its slowest stage or link, or, for a
plan whose schedule ``pipedream-partition --schedule`` chose (``settings["schedule"]``), that schedule's simulated
time per minibatch on the processes that train it. ``data_parallel_time_s`` is plain data parallelism's on the same
processes (for a plan of several stages per process, on those processes, not one per stage).
Ranks of a flat plan are given to stages in order, each stage a contiguous block. Ranks of a hierarchical plan
follow the machine hierarchy (see :func:`aligned_ranks`): rank ``g`` sits on the level-1 machine
``g // n_1``, the level-2 machine ``g // (n_1 n_2)``, and so on, and every machine runs the part of the plan
the hierarchy gave it, so a stage's replicas occupy as few machines as the plan allows and a stage that
fits on one machine never straddles two.

``recompute`` (optional, default empty) lists the *value* layers (``Layer.kind == "value"``: shape arithmetic
and other outputs holding no tensor). They are never sent between stages: a stage that needs one recomputes
it, and its value-layer ancestors, from its tensor roots, which the plan has made available in that stage.
Each is still listed in one stage (that of its earliest consumer, or the last stage), so that every layer
belongs to exactly one stage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "PlanError", "PlanStage", "Plan", "load_plan", "LevelPlan", "aligned_ranks"]

PLAN_FORMAT = "pipedream-ft-plan"
PLAN_VERSION = 1


class PlanError(ValueError):
    """A plan is malformed, or does not fit the model or world it is used with."""


LevelPlan = Sequence[tuple[int, Union["LevelPlan", None]]]
"""A plan of one level of a machine hierarchy: its stages in pipeline order, each as ``(replicas, inner)``:
``replicas`` machines of the level below run the stage, and ``inner`` is the plan each of them runs
(a :data:`LevelPlan` one level further in), or None at the innermost level, whose machines are workers."""


def aligned_ranks(workers: Sequence[int], plan: LevelPlan) -> list[tuple[int, ...]]:
    """Global ranks of the innermost stages of a hierarchical ``plan``, aligned to machine boundaries.

    ``workers`` gives the machines per level, innermost first (``[8, 16, 8]``: 8 workers per node, 16 nodes
    per rack, 8 racks); ``plan`` is the outermost level's :data:`LevelPlan`. A level-``l`` machine holds the
    consecutive ranks ``[m U_l, (m+1) U_l)`` with ``U_l = n_1 ... n_l``. Each stage of a level-``l`` plan is
    given ``replicas`` consecutive level-``(l-1)`` machines, in pipeline order, and every one of them runs the
    stage's inner plan on its own ranks. An innermost stage with ``r_1`` workers in a plan replicated
    ``r_2 ... r_L`` times above it thus gets ``r_1`` consecutive ranks on each of ``r_2 ... r_L`` nodes: the
    fewest nodes it can use, and it straddles no node. Returns one rank tuple (ascending) per innermost
    stage, in pipeline order; raises :class:`PlanError` if a level's replica counts do not add up to its
    machine count.
    """
    workers = [int(n) for n in workers]
    if not workers or any(n < 1 for n in workers):
        raise PlanError(f"workers must list a positive machine count per level, got {workers}")
    def leaves(level: int, sub: LevelPlan, base: int) -> list[list[int]]:
        unit = 1
        for n in workers[:level]:
            unit *= n
        result: list[list[int]] = []
        used = 0
        for replicas, inner in sub:
            if isinstance(replicas, bool) or int(replicas) != replicas or replicas < 1:
                raise PlanError(f"level {level + 1}: replicas must be a whole number >= 1, got {replicas!r}")
            if (inner is None) != (level == 0):
                raise PlanError(f"level {level + 1}: " + ("an innermost stage cannot have an inner plan" if level == 0
                                                           else "a stage needs the plan its machines run"))
            if level == 0:
                result.append(list(range(base + used, base + used + replicas)))
            else:
                merged: list[list[int]] | None = None
                for i in range(replicas):
                    part = leaves(level - 1, inner, base + (used + i) * unit)
                    merged = part if merged is None else [m + q for m, q in zip(merged, part)]
                result.extend(merged or [])
            used += replicas
        if used != workers[level]:
            raise PlanError(f"level {level + 1}: stages use {used} machines, but the level has {workers[level]}")
        return result

    return [tuple(sorted(r)) for r in leaves(len(workers) - 1, plan, 0)]


@dataclass(frozen=True, slots=True)
class PlanStage:
    """One pipeline stage."""

    index: int
    """Position in the pipeline, from 0."""
    layers: tuple[int, ...]
    """Profile layer indices, ascending."""
    replicas: int
    """Number of data-parallel workers running this stage."""
    ranks: tuple[int, ...]
    """Global ranks of those workers."""
    time_s: float = 0.0
    """Predicted time per minibatch of this stage, seconds."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise PlanError(f"stage {self.index}: replicas must be >= 1, got {self.replicas}")
        if len(self.ranks) != self.replicas:
            raise PlanError(f"stage {self.index}: {self.replicas} replicas but ranks {list(self.ranks)}")
        if not self.layers:
            raise PlanError(f"stage {self.index} has no layers")


@dataclass(frozen=True, slots=True)
class Plan:
    """A pipeline plan: stages in order, each with its layers and ranks."""

    stages: tuple[PlanStage, ...]
    profile_hash: str
    layer_names: tuple[str, ...]
    time_per_minibatch_s: float = 0.0
    data_parallel_time_s: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)
    recompute: tuple[int, ...] = ()
    """Value layers (indices, ascending): recomputed by any stage that needs them, never sent."""

    def __post_init__(self) -> None:
        if not self.stages:
            raise PlanError("plan has no stages")
        if list(self.recompute) != sorted(set(self.recompute)) or not all(
            isinstance(i, int) and 0 <= i < len(self.layer_names) for i in self.recompute
        ):
            raise PlanError(
                f"recompute must list distinct layer indices in 0..{len(self.layer_names) - 1}, ascending; "
                f"got {list(self.recompute)[:8]}"
            )
        seen: dict[int, int] = {}
        for s in self.stages:
            for layer in s.layers:
                if not 0 <= layer < len(self.layer_names):
                    raise PlanError(f"stage {s.index} names layer {layer}, but the model has {len(self.layer_names)}")
                if layer in seen:
                    raise PlanError(f"layer {layer} is in stages {seen[layer]} and {s.index}")
                seen[layer] = s.index
        missing = [i for i in range(len(self.layer_names)) if i not in seen]
        if missing:
            raise PlanError(f"layers {missing[:8]} belong to no stage")
        ranks = [r for s in self.stages for r in s.ranks]
        if sorted(ranks) != list(range(len(ranks))):
            raise PlanError(f"stage ranks must cover 0..{len(ranks) - 1} once each, got {ranks}")
        if [s.index for s in self.stages] != list(range(len(self.stages))):
            raise PlanError("stage indices must be 0, 1, 2, ... in order")

    # -- derived views ------------------------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def world_size(self) -> int:
        return sum(s.replicas for s in self.stages)

    @property
    def layer_to_stage(self) -> list[int]:
        out = [0] * self.num_layers
        for s in self.stages:
            for layer in s.layers:
                out[layer] = s.index
        return out

    @property
    def stage_to_ranks(self) -> list[list[int]]:
        return [list(s.ranks) for s in self.stages]

    @property
    def speedup_over_data_parallel(self) -> float:
        if self.time_per_minibatch_s <= 0:
            return 1.0
        return self.data_parallel_time_s / self.time_per_minibatch_s

    def stage_of_rank(self, rank: int) -> PlanStage:
        for s in self.stages:
            if rank in s.ranks:
                return s
        raise PlanError(f"rank {rank} is not in the plan (world size {self.world_size})")

    def check_fits(self, *, profile_hash: str | None, num_layers: int, world_size: int) -> None:
        """Raise :class:`PlanError` naming the mismatch if this plan was made for another model or world."""
        if num_layers != self.num_layers:
            raise PlanError(f"plan is for a model of {self.num_layers} layers, but this model has {num_layers}")
        if profile_hash is not None and profile_hash != self.profile_hash:
            raise PlanError(
                f"plan was made for another model: profile hash {self.profile_hash[:12]} != model's {profile_hash[:12]}"
            )
        if world_size != self.world_size:
            raise PlanError(f"plan needs {self.world_size} workers, but the world size is {world_size}")

    # -- construction ---------------------------------------------------------------------------------------

    @staticmethod
    def from_stages(
        stage_layers: Sequence[Sequence[int]],
        replicas: Sequence[int],
        *,
        profile_hash: str,
        layer_names: Sequence[str],
        stage_times_s: Sequence[float] | None = None,
        time_per_minibatch_s: float = 0.0,
        data_parallel_time_s: float = 0.0,
        settings: dict[str, Any] | None = None,
        recompute: Sequence[int] = (),
        ranks: Sequence[Sequence[int]] | None = None,
    ) -> Plan:
        """Build the plan; ``ranks`` gives each stage's ranks (default: contiguous blocks in stage order,
        see :func:`aligned_ranks` for a machine hierarchy)."""
        if len(stage_layers) != len(replicas):
            raise PlanError(f"{len(stage_layers)} stages but {len(replicas)} replica counts")
        if ranks is not None and len(ranks) != len(replicas):
            raise PlanError(f"{len(stage_layers)} stages but {len(ranks)} rank lists")
        stages = []
        next_rank = 0
        for i, (layers, r) in enumerate(zip(stage_layers, replicas)):
            if ranks is None:
                stage_ranks = tuple(range(next_rank, next_rank + r))
            else:
                stage_ranks = tuple(sorted(int(x) for x in ranks[i]))
            next_rank += r
            t = float(stage_times_s[i]) if stage_times_s is not None else 0.0
            stages.append(PlanStage(i, tuple(sorted(layers)), int(r), stage_ranks, t))
        return Plan(
            tuple(stages),
            profile_hash,
            tuple(layer_names),
            float(time_per_minibatch_s),
            float(data_parallel_time_s),
            dict(settings or {}),
            tuple(sorted(int(i) for i in recompute)),
        )

    # -- JSON -----------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "profile_hash": self.profile_hash,
            "num_layers": self.num_layers,
            "layer_names": list(self.layer_names),
            "workers": self.world_size,
            "stages": [
                {"index": s.index, "layers": list(s.layers), "replicas": s.replicas, "ranks": list(s.ranks), "time_s": s.time_s}
                for s in self.stages
            ],
            "layer_to_stage": self.layer_to_stage,
            "stage_to_ranks": self.stage_to_ranks,
            "time_per_minibatch_s": self.time_per_minibatch_s,
            "data_parallel_time_s": self.data_parallel_time_s,
            "speedup_over_data_parallel": self.speedup_over_data_parallel,
            "settings": self.settings,
            "recompute": list(self.recompute),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1) + "\n"

    def save(self, path: str | Path) -> None:
        """Write the plan JSON atomically (a temporary file renamed into place)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.dumps())
        tmp.replace(path)

    @staticmethod
    def from_json(data: Any, source: str = "<plan>") -> Plan:
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanError(f"{source}: not a pipedream-ft plan (field 'format' must be {PLAN_FORMAT!r})")
        if data.get("version") != PLAN_VERSION:
            raise PlanError(f"{source}: unsupported plan version {data.get('version')!r}")
        try:
            stages = tuple(
                PlanStage(int(s["index"]), tuple(int(x) for x in s["layers"]), int(s["replicas"]),
                          tuple(int(x) for x in s["ranks"]), float(s.get("time_s", 0.0)))
                for s in data["stages"]
            )
            return Plan(
                stages,
                str(data["profile_hash"]),
                tuple(str(x) for x in data["layer_names"]),
                float(data.get("time_per_minibatch_s", 0.0)),
                float(data.get("data_parallel_time_s", 0.0)),
                dict(data.get("settings", {})),
                _indices(data.get("recompute", []), "recompute"),
            )
        except KeyError as exc:
            raise PlanError(f"{source}: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise PlanError(f"{source}: {exc}") from None


def _indices(raw: Any, key: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        raise PlanError(f"field {key!r} must be a list of layer indices, got {raw!r}")
    return tuple(raw)


def load_plan(path: str | Path) -> Plan:
    """Read a plan JSON file; errors name the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise PlanError(f"{path}: cannot read plan: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    return Plan.from_json(data, source=str(path))
