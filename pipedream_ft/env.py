"""Everything the library reads from the environment, read in one place.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
``MASTER_PORT`` and, under its
elastic agent, ``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_USE_AGENT_STORE``.
A supervisor (:func:`pipedream_ft.launch`) hands the process it starts its own :class:`DistEnv`
(:func:`hand_over`: recovery mode, incarnation, the round it joins, the supervisor's id), which :func:`read_env`
returns there; nothing is written to ``os.environ``. The user may set ``PIPEDREAM_FT_RECOVERY`` (the recovery
mode :func:`pipedream_ft.launch` picks, :func:`requested_recovery`) and ``PIPEDREAM_FT_LOG_DIR`` (where a crashed
process's traceback goes, see :mod:`pipedream_ft.crashlog`).
Every field can be overridden by keyword, so tests and notebooks need no environment at all.

The user's other settings are read through :func:`setting`, by name from :data:`SETTINGS` (the defaults of
:class:`~pipedream_ft.PipelineConfig`'s fields, the job's secret, fault injection for drills).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

__all__ = ["DistEnv", "SETTINGS", "hand_over", "read_env", "reported_rank", "requested_recovery", "setting"]

SETTINGS = {
    "PIPEDREAM_FT_HEALTH_FILE": "a file refreshed while the rank makes progress (PipelineConfig.health_file)",
    "PIPEDREAM_FT_TRACE_DIR": "where each rank writes its timeline trace (PipelineConfig.trace_dir)",
    "PIPEDREAM_FT_METRICS_DIR": "where each rank writes its metrics lines (PipelineConfig.metrics_dir)",
    "PIPEDREAM_FT_SECRET": "the job's secret, signing its store keys and memory-tier parts (ft/secret.py)",
    "PIPEDREAM_FT_FAULTS": "faults to inject, for tests and drills (ft/faults.py)",
    "PIPEDREAM_FT_PROFILE": "the model's profile, for a script that re-plans when it runs on another number of "
                            "processes than its plan's (the pool sets it to each job's submitted profile)",
    "XDG_RUNTIME_DIR": "this user's private runtime directory, home of the job's key (ft/secret.py)",
}
"""The environment variables :func:`setting` reads, and what each is for."""


def reported_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank for an error line: ``RANK`` alone, unchecked (reporting an error must not fail on the
    rest of the environment); 0 if unset or not a number."""
    raw = (os.environ if environ is None else environ).get("RANK", "")
    return int(raw) if raw.strip().isdigit() else 0


def setting(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of setting ``name`` (one of :data:`SETTINGS`) in ``environ`` (default ``os.environ``); ``None``
    if unset or empty."""
    if name not in SETTINGS:
        raise KeyError(f"unknown setting {name!r}: expected one of {', '.join(SETTINGS)}")
    value = (os.environ if environ is None else environ).get(name)
    return value or None


@dataclass(kw_only=True, frozen=True, slots=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int = 0
    """Global rank of this process."""
    world_size: int = 1
    """Number of processes in the job."""
    local_rank: int = 0
    """Rank on this machine; picks the GPU under NCCL."""
    local_world_size: int = 0
    """Processes on this machine (0: unknown, then the whole world is taken as one machine)."""
    node: int = 0
    """Which machine of the job this is (torchrun's ``GROUP_RANK``)."""
    master_addr: str = "127.0.0.1"
    """Host of the rendezvous store."""
    master_port: int = 29500
    """Port of the rendezvous store."""
    restart_count: int = 0
    """How many times torchrun has restarted the worker group."""
    run_id: str = "none"
    """torchrun's run id; keys in a shared store are scoped by it."""
    use_agent_store: bool = False
    """True when torchrun's agent hosts the store and workers connect to it as clients."""
    recovery: str = "restart"
    """``"in-place"`` when a supervisor (:func:`pipedream_ft.launch`) replaces this process if it dies and the
    others recover without restarting; ``"restart"`` when a failure ends every process (torchrun restarts them)."""
    incarnation: int = 0
    """How many processes before this one held this rank in the current group (in-place recovery)."""
    live_round: str | None = None
    """The group this replacement process joins (in-place recovery; set by its supervisor)."""
    supervisor: str | None = None
    """The id of the supervisor that started this process (unique per supervisor process, on every node and in
    every torchrun attempt): the store keys a supervisor reads are the ones its own processes wrote."""
    log_dir: str | None = None
    """Where a crashed process writes its full traceback (default ``./pipedream-ft-logs/<run id>``)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")
        if self.local_world_size < 0 or self.node < 0:
            raise ValueError(f"local_world_size and node must be >= 0, got {self.local_world_size}, {self.node}")
        if self.recovery not in ("restart", "in-place"):
            raise ValueError(f"recovery must be 'restart' or 'in-place', got {self.recovery!r}")
        if self.incarnation < 0:
            raise ValueError(f"incarnation must be >= 0, got {self.incarnation}")

    @property
    def ranks_per_node(self) -> int:
        """Ranks on one machine (the whole world when torchrun did not say)."""
        return self.local_world_size or self.world_size


_VARS = {
    "rank": ("RANK", int),
    "world_size": ("WORLD_SIZE", int),
    "local_rank": ("LOCAL_RANK", int),
    "local_world_size": ("LOCAL_WORLD_SIZE", int),
    "node": ("GROUP_RANK", int),
    "master_addr": ("MASTER_ADDR", str),
    "master_port": ("MASTER_PORT", int),
    "restart_count": ("TORCHELASTIC_RESTART_COUNT", int),
    "run_id": ("TORCHELASTIC_RUN_ID", str),
    "use_agent_store": ("TORCHELASTIC_USE_AGENT_STORE", lambda v: v.strip().lower() in ("1", "true", "yes")),
    "recovery": ("PIPEDREAM_FT_RECOVERY", str),
    "incarnation": ("PIPEDREAM_FT_INCARNATION", int),
    "live_round": ("PIPEDREAM_FT_ROUND", str),
    "supervisor": ("PIPEDREAM_FT_SUPERVISOR", str),
    "log_dir": ("PIPEDREAM_FT_LOG_DIR", str),
}


_handed: DistEnv | None = None
"""The environment a supervisor handed this process (see :func:`hand_over`)."""


def hand_over(env: DistEnv | None) -> None:
    """Make ``env`` this process's environment: :func:`read_env` returns it (with any overrides) instead of
    reading ``os.environ``. A supervisor calls it in the training process it starts; ``None`` undoes it."""
    global _handed
    if env is not None and not isinstance(env, DistEnv):
        raise TypeError(f"hand_over needs a DistEnv or None, got {type(env).__name__}")
    _handed = env


def requested_recovery(environ: Mapping[str, str] | None = None) -> str | None:
    """The recovery mode the user asked for with ``PIPEDREAM_FT_RECOVERY`` (``None``: unset, the launcher
    picks)."""
    return (os.environ if environ is None else environ).get("PIPEDREAM_FT_RECOVERY") or None


def read_env(environ: Mapping[str, str] | None = None, **overrides: Any) -> DistEnv:
    """Build a :class:`DistEnv` from ``environ`` (default: the one handed to this process by its supervisor, else
    ``os.environ``), then apply ``overrides``."""
    known = {f.name for f in fields(DistEnv)}
    unknown = set(overrides) - known
    if unknown:
        raise TypeError(f"unknown DistEnv fields: {sorted(unknown)}")
    if environ is None and _handed is not None:
        return replace(_handed, **overrides) if overrides else _handed
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for field_name, (var, conv) in _VARS.items():
        raw = environ.get(var)
        if raw is None or raw == "":
            continue
        try:
            values[field_name] = conv(raw)
        except ValueError:
            raise ValueError(f"environment variable {var}={raw!r} is not valid") from None
    return replace(DistEnv(**values), **overrides) if overrides else DistEnv(**values)
