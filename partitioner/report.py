"""What ``pipedream-partition`` prints about a plan: its stages, and each predicted figure with what it means.

Words, used the same way in every line: a *process* is one training process (``--workers`` counts them; a rank of
``torchrun``); a *stage* is a contiguous part of the model. A plain plan runs each stage on one or more processes
(its replicas); a plan of *virtual stages* (``--schedule interleaved_1f1b`` and the like) gives each process
several stages. A *minibatch* is what one forward and backward of the whole model take in (torch's pipelining
calls it a microbatch); a *step* is ``flush_every`` minibatches, one optimizer update in ``flush`` mode.

The predicted time per minibatch is the plan's ``time_per_minibatch_s``: with no schedule chosen, PipeDream's
steady state (the slowest stage sets the pace once the pipeline is full); with a schedule chosen
(``--schedule``), that schedule's simulated step divided by its minibatches, the same figure as its row of the
ranking. ``data_parallel_time_s`` is plain data parallelism on the same processes (the whole model on each,
weights all-reduced every minibatch); the speedup is its time over the plan's, so under 1 the plan is predicted
slower than data parallelism.
"""

from __future__ import annotations

from typing import Any, Sequence

from .plan import Plan

__all__ = ["layer_ranges", "format_plan", "placement_of", "processes", "is_data_parallel", "data_parallel_note",
           "speedup_line"]


def layer_ranges(layers: tuple[int, ...] | list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    out = []
    items = sorted(layers)
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)


def _schedule(plan: Plan) -> dict[str, Any] | None:
    record = plan.settings.get("schedule")
    return record if isinstance(record, dict) and isinstance(record.get("name"), str) else None


def placement_of(plan: Plan) -> dict[int, int] | None:
    """Stage -> process for a plan of virtual stages (its recorded schedule gives each process several stages);
    None for a plan whose stages run on their own ranks."""
    record = _schedule(plan)
    if record is None or not isinstance(record.get("stages_per_worker"), int) or record["stages_per_worker"] < 2:
        return None
    from pipedream_ft.schedules.placement import loop_placement, v_placement

    workers, v = int(record["workers"]), int(record["stages_per_worker"])
    where = v_placement(workers) if record["name"] in ("zbv", "dualpipev") else loop_placement(workers, v)
    return where if len(where) == plan.num_stages else None  # a record that is not this plan's: its own ranks


def processes(plan: Plan) -> int:
    """How many processes train the plan: the plan's ranks, or for virtual stages the processes that hold them."""
    where = placement_of(plan)
    return plan.world_size if where is None else len(set(where.values()))


def is_data_parallel(plan: Plan) -> bool:
    """One stage, the whole model, replicated on every process (of two or more): no pipeline at all."""
    return plan.num_stages == 1 and plan.world_size > 1


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  ".join(v.ljust(w) if c == 1 else v.rjust(w) for c, (v, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def _where(plan: Plan) -> str:
    """The machine the figures are predicted for, in words."""
    machine = plan.settings.get("machine")
    if machine is not None:
        return "under the measured machine's costs"
    bandwidth = plan.settings.get("bandwidth")
    if isinstance(bandwidth, list) and bandwidth:
        return "at " + " / ".join(f"{b:g}" for b in bandwidth) + " bytes/s"
    return "at the planned bandwidth"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def speedup_line(plan: Plan) -> str:
    """The speedup over data parallelism, saying what it is and, under 1, what that means and why it happened."""
    s = plan.speedup_over_data_parallel
    procs = processes(plan)
    head = f"speedup over data parallelism: {s:.3f}x"
    if is_data_parallel(plan):
        return f"{head} (this plan is data parallelism)"
    if plan.data_parallel_time_s <= 0 or plan.time_per_minibatch_s <= 0:
        return f"{head} (no prediction: the profile's layers take no time)"
    head += " (data parallelism's time per minibatch over this plan's)"
    against = f"data parallelism on {procs} processes {_where(plan)}"
    if s >= 1:
        return f"{head}: at or above 1, this plan is predicted {s:.2f}x as fast as {against}"
    why = []
    if plan.settings.get("straight"):
        why.append("--straight forced a pipeline (without it the planner picks the fastest plan, data parallelism "
                   "included)")
    elif plan.settings.get("memory_bytes") is not None:
        why.append("data parallelism holds the whole model on each process, which --memory may rule out")
    if _schedule(plan) is not None:
        why.append("the schedule's bubble is counted, data parallelism has none")
    return f"{head}: under 1, this plan is predicted {1 / s:.2f}x slower than {against}" + \
        ("; " + "; ".join(why) if why else "")


def data_parallel_note(plan: Plan, straight_time_s: float | None = None) -> str | None:
    """For a plan that is pure data parallelism, the one line saying so, why, and what to do; else None.
    ``straight_time_s``: the best straight pipeline's predicted time per minibatch, when one exists."""
    if not is_data_parallel(plan):
        return None
    procs = plan.world_size
    than = (f" (a straight pipeline of {procs} stages: {_ms(straight_time_s)} per minibatch, against "
            f"{_ms(plan.time_per_minibatch_s)})" if straight_time_s is not None else "")
    return (f"note: this plan is pure data parallelism, no pipeline: one stage, the whole model replicated on all "
            f"{procs} processes; {_where(plan)} it is predicted faster than any pipeline{than}, as for a model whose "
            "weights are small for the bandwidth, or a profile measured on a busy machine (noisy layer times); "
            "plan with --straight to train a pipeline anyway")


def format_plan(plan: Plan) -> str:
    """A readable table of the plan's stages, and its predicted figures, each saying what it is."""
    where = placement_of(plan)
    procs = processes(plan)
    if where is None:
        rows = [("stage", "layers", "replicas", "processes", "ms/minibatch")]
        rows += [(str(s.index), layer_ranges(s.layers), str(s.replicas), layer_ranges(s.ranks), f"{s.time_s * 1e3:.3f}")
                 for s in plan.stages]
    else:
        rows = [("stage", "layers", "process", "ms/minibatch")]
        rows += [(str(s.index), layer_ranges(s.layers), str(where[s.index]), f"{s.time_s * 1e3:.3f}")
                 for s in plan.stages]
    lines = _table(rows)
    stages = plan.num_stages
    if where is not None:
        held = {p: [s for s in sorted(where) if where[s] == p] for p in sorted(set(where.values()))}
        record = _schedule(plan)
        assert record is not None
        lines.append(f"{stages} stages on {procs} processes, {stages // procs} each (where {record['name']} places "
                     "them); ms/minibatch: a stage's own forward and backward per minibatch (its compute, or its "
                     "transfers where slower); a process runs its stages one after another, the sum of their "
                     "times: " + ", ".join(f"process {p} {_ms(sum(plan.stages[s].time_s for s in ss))}"
                                           for p, ss in held.items())
                     + " (at most: where a stage's time is its transfers, they overlap the process's compute)")
    elif is_data_parallel(plan):
        lines.append(f"1 stage on {procs} processes (data parallelism); ms/minibatch: its time per minibatch, the "
                     "compute divided among the replicas plus their weight all-reduce")
    else:
        share = "one stage each" if stages == procs else "replicas as listed"
        lines.append(f"{stages} stages on {procs} processes, {share}; ms/minibatch: a stage's time per minibatch (its "
                     "compute divided among its replicas plus their weight all-reduce, or its transfers where slower)")
    lines.append(_predicted(plan, virtual=where is not None))
    if not is_data_parallel(plan):
        lines.append(f"data parallelism (the whole model on each of the {procs} processes) is predicted "
                     f"{_ms(plan.data_parallel_time_s)} per minibatch")
    lines.append(speedup_line(plan))
    if plan.recompute:
        lines.append(f"value layers recomputed where needed (never sent): {len(plan.recompute)}")
    return "\n".join(lines)


def _predicted(plan: Plan, *, virtual: bool) -> str:
    head = f"predicted time per minibatch: {_ms(plan.time_per_minibatch_s)}"
    record = _schedule(plan)
    if record is None and is_data_parallel(plan):
        return head + " (the one stage's)"
    if record is None:
        return head + (" (the slowest stage's: the pipeline's pace once full, as PipeDream's asynchronous 1F1B runs "
                       "it; a flushing schedule adds its bubble, which --schedule simulates)")
    name, m = record["name"], record.get("microbatches")
    slowest = "" if virtual else f"; the slowest stage alone: {_ms(max(s.time_s for s in plan.stages))}"
    if name == "pipedream":
        return (head + " with pipedream, asynchronous (simulated, see the schedules below; the optimizer steps every "
                f"minibatch){slowest}")
    step = f", {_ms(plan.time_per_minibatch_s * m)} per step of {m} minibatches (flush_every={m})" \
        if isinstance(m, int) else ""
    return head + f" with {name} (simulated, see the schedules below){step}" + \
        (f"{slowest}, the pace with no flush" if slowest else "")
