"""Pipeline schedules as data, without torch: actions, generators, passes, a simulator and CSV tables.

A schedule maps each rank to the actions it runs in order (:class:`Action`: stage, kind, minibatch, printed
``2F5``). Generators return compute-only schedules; :func:`add_updates` and :func:`add_communication` add
the updates and the sends/receives; :func:`simulate` checks a schedule and predicts its step time and each
rank's idle time from per-stage costs; :func:`render` draws it as text, :func:`save_trace` as a trace that
``pipedream-timeline`` draws; :class:`WindowSchedule` holds one window of a synchronous schedule given as a
table or a mapping, checked, for the runtime's ``flush`` mode.
"""

from .actions import Action, Kind, Schedule, compute_only, parse_action
from .catalog import SCHEDULES, Built, build
from .comms import add_communication
from .costs import Costs
from .errors import ScheduleError
from .memory import peak_in_flight
from .looped import interleaved_1f1b, interleaved_zero_bubble, looped_bfs
from .placement import loop_placement, stage_to_rank, v_placement
from .render import render
from .simulate import Span, Timeline, simulate
from .straight import gpipe, one_f_one_b, pipedream, zb_h1
from .tables import from_csv, load_csv, save_csv, to_csv
from .trace import save_trace, to_trace
from .updates import add_updates
from .vshape import dualpipev, zbv
from .window import WindowSchedule, resolve_schedule

__all__ = [
    "Action", "Kind", "Schedule", "compute_only", "parse_action",
    "SCHEDULES", "Built", "build",
    "add_communication", "add_updates",
    "Costs", "ScheduleError",
    "gpipe", "one_f_one_b", "zb_h1", "pipedream",
    "interleaved_1f1b", "interleaved_zero_bubble", "looped_bfs",
    "zbv", "dualpipev",
    "loop_placement", "v_placement", "stage_to_rank",
    "simulate", "Span", "Timeline", "render", "peak_in_flight",
    "to_csv", "from_csv", "save_csv", "load_csv",
    "to_trace", "save_trace",
    "WindowSchedule", "resolve_schedule",
]
