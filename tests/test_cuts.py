"""A cut's flags (pipedream_ft/ft/cuts.py): ft/ owns their meaning; the executor carries them and asks ``stops``."""

from __future__ import annotations

import inspect

import pipedream_ft.pipeline.executor as executor
from pipedream_ft.ft.cuts import CUT, DURABLE, REPLAN, STOP, describe, stops


def test_flags_are_distinct_bits_and_say_what_they_mean():
    bits = [CUT, STOP, DURABLE, REPLAN]
    assert all(b and b & (b - 1) == 0 for b in bits) and len(set(bits)) == 4
    assert not stops(CUT) and not stops(CUT | DURABLE) and stops(CUT | STOP) and stops(CUT | DURABLE | STOP | REPLAN)
    assert describe(CUT | DURABLE) == "cut+durable" and describe(0) == "none"
    assert describe(CUT | STOP | DURABLE | REPLAN) == "cut+stop+durable+replan"


def test_the_executor_reads_no_cut_flag_itself():
    source = inspect.getsource(executor)
    assert "..ft" not in source  # pipeline/ never imports ft/
    for name in ("CUT", "STOP", "DURABLE", "REPLAN"):
        assert not hasattr(executor, name), name
