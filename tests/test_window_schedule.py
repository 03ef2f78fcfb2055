"""A synchronous schedule given as data (a table or a mapping): what it runs, and each way it is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from partitioner.plan import PlanError
from pipedream_ft import PipelineConfig
from pipedream_ft.pipeline.modes import Flush, make_mode
from pipedream_ft.schedules.replicated import synchronous
from pipedream_ft.schedules.window import WindowSchedule, resolve_schedule, virtual_schedule
from pipedream_ft.schedules import add_communication, build, parse_action, save_csv

pytestmark = pytest.mark.timeout(60)


def mixed(stages: int = 4, m: int = 4) -> dict[int, list[str]]:
    """All forwards, then the backwards in order: whole ones for even minibatches, split ones for odd, whose
    weight gradients wait for the end of the window. No built-in schedule runs this."""
    out = {}
    for s in range(stages):
        row = [f"{s}F{b}" for b in range(m)]
        row += [f"{s}B{b}" if b % 2 == 0 else f"{s}I{b}" for b in range(m)]
        out[s] = row + [f"{s}W{b}" for b in range(1, m, 2)]
    return out


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zb_h1"])
def test_a_built_in_schedule_written_as_a_table_runs_as_the_built_in(tmp_path, name):
    built = build(name, 4, 8)
    path = tmp_path / f"{name}.csv"
    save_csv(add_communication(built.schedule, built.placement), path)  # sends and receives are skipped
    table = WindowSchedule.load(path)
    assert table.microbatches == 8 and table.num_stages == 4 and str(table) == str(path)
    for stage in range(4):
        assert table.actions(stage, 8, 24) == synchronous(name, stage, 0, [1] * 4, 8, 24, 8)


def test_a_mapping_runs_window_after_window_with_one_update_each():
    table = WindowSchedule.of(mixed())
    assert [str(a) for a in table.actions(2, 4, 8)] == (
        "2F4 2F5 2F6 2F7 2B4 2I5 2B6 2I7 2W5 2W7 2U1".split())
    assert str(table).startswith("python schedule ") and table.digest() == WindowSchedule.of(mixed()).digest()
    with pytest.raises(ValueError, match=r"minibatches \[2, 8\) are not whole windows of 4"):
        table.actions(0, 2, 8)


def test_a_closing_update_is_dropped_and_the_runtime_adds_its_own():
    rows = {s: r + [f"{s}U0"] for s, r in mixed(2, 2).items()}
    assert WindowSchedule.of(rows).actions(1, 0, 2) == WindowSchedule.of(mixed(2, 2)).actions(1, 0, 2)


@pytest.mark.parametrize("change, error", [
    (lambda t: t.update({1: [a.replace("1", "2", 1) for a in t[1]]}),
     r"stage 2 runs on two ranks: 1 and 2 \(2F0\)"),
    (lambda t: t.update({0: t[0][:-1]}), r"stage 0 runs 0F3, 0I3 for minibatch 3; expected 0F3 and either 0B3 or "
                                          r"0I3 then 0W3, once each"),
    (lambda t: t.update({3: [a for a in t[3] if a != "3F2"]}), r"stage 3 runs the forwards of minibatches \[0, 1, 3\]"),
    (lambda t: t.update({0: ["0F1", "0F0"] + t[0][2:]}), r"stage 0 runs its forwards in the order \[1, 0, 2, 3\]"),
    (lambda t: t.update({2: ["2B0"] + [a for a in t[2] if a != "2B0"]}), "2B0 comes before 2F0"),
    (lambda t: t.update({1: "1F0 1F1 1F2 1F3 1B0 1W1 1I1 1B2 1I3 1W3".split()}),
     r"1W1 comes before 1I1 \(the weight gradient needs the input gradient's backward first\)"),
    (lambda t: t.update({2: t[2][:5] + ["2U0"] + t[2][5:]}), "2U0 comes before the end of the window"),
    (lambda t: t.update({5: t.pop(3)}), r"ranks must be 0..S-1, got \[0, 1, 2, 5\]"),
])
def test_a_table_that_cannot_run_is_refused_naming_what(change, error):
    table = mixed()
    change(table)
    with pytest.raises(ValueError, match=error):
        WindowSchedule.of(table)


def test_a_table_that_would_wait_for_ever_names_the_stuck_actions():
    table = {0: ["0F0", "0F1", "0I1", "0B0", "0W1"], 1: ["1F0", "1F1", "1I1", "1B0", "1W1"]}
    WindowSchedule.of(table)  # backwards out of minibatch order run, as long as both stages agree
    table[0] = ["0F0", "0B0", "0F1", "0I1", "0W1"]  # 0B0 waits for 1B0, which comes after 1F1, which waits for 0F1
    with pytest.raises(ValueError, match="cannot run to its end: deadlock: rank 0 at 0B0 waits for 1B0; rank 1 "
                                         "at 1F1 waits for 0F1"):
        WindowSchedule.of(table)


def test_the_sends_and_receives_a_table_has_are_checked_too():
    built = build("1f1b", 2, 2)
    table = {r: [a for a in actions if a is not None]
             for r, actions in add_communication(built.schedule, built.placement).items()}
    WindowSchedule.of(table)
    table[1] = [a for a in table[1] if str(a) != "1RECV_F1"]
    with pytest.raises(ValueError, match="cannot run to its end: .*0SEND_F1"):
        WindowSchedule.of(table)


def test_a_table_file_that_cannot_be_read_or_parsed_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"cannot read the schedule table .*nope\.csv"):
        WindowSchedule.load(tmp_path / "nope.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0B0\n1F0,1X0\n")
    with pytest.raises(ValueError, match=r"bad\.csv: row 1 \(rank 1\), column 1: bad action '1X0'"):
        WindowSchedule.load(bad)


def test_the_config_takes_a_path_or_a_mapping_and_checks_the_window_and_the_mode(tmp_path):
    path = tmp_path / "mixed.csv"
    save_csv({s: [parse_action(a) for a in r] for s, r in mixed().items()}, path)
    for given in (str(path), path, mixed()):
        config = PipelineConfig(mode="flush", flush_every=4, schedule=given)
        assert isinstance(config.schedule, WindowSchedule) and config.schedule.microbatches == 4
    with pytest.raises(ValueError, match="runs windows of 4 minibatches; flush_every is 8"):
        PipelineConfig(mode="flush", flush_every=8, schedule=str(path))
    with pytest.raises(ValueError, match="is synchronous \\(mode 'flush'\\); mode 'stash' runs"):
        PipelineConfig(mode="stash", schedule=mixed())
    with pytest.raises(TypeError, match="schedule must be a name, a table's path"):
        resolve_schedule(3)  # type: ignore[arg-type]
    assert resolve_schedule("gpipe") == "gpipe"


def test_flush_mode_checks_the_plan_against_the_table():
    mode = make_mode("flush", 4, None, mixed())
    assert isinstance(mode, Flush) and "python schedule" in repr(mode)
    mode.check(SimpleNamespace(replicas=(1, 1, 1, 1)))  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="has 4 stages \\(one per rank\\), the plan 3"):
        mode.check(SimpleNamespace(replicas=(1, 1, 1)))  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"runs a straight pipeline; the plan replicates stages \[1\]"):
        mode.check(SimpleNamespace(replicas=(1, 2, 1, 1)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="runs windows of 4 minibatches; flush_every is 2"):
        Flush(2, mixed())


def test_a_rank_may_hold_several_stages_and_runs_their_actions_interleaved():
    """Virtual stages: interleaved 1F1B on 2 ranks, 4 stages; each stage's actions are the rank's row projected on
    it, and the rank's actions per window end with an update of each of its stages."""
    built = virtual_schedule("interleaved_1f1b", 2, 4)
    rows = {r: [str(a) for a in built.rows[r]] for r in (0, 1)}
    table = WindowSchedule.of(rows)
    assert table.virtual and table.num_ranks == 2 and table.num_stages == 4
    assert table.placement == (0, 1, 0, 1) and table.stages_of(0) == [0, 2] and table.stages_of(1) == [1, 3]
    assert table.orders == built.orders
    got = [str(a) for a in table.rank_actions(0, 4, 8)]
    assert got[-2:] == ["0U1", "2U1"] and got[:-2] == [f"{a.stage}{a.kind.value}{a.index + 4}" for a in built.rows[0]]
    for stage in (0, 2):
        assert table.actions(stage, 4, 8) == [a for a in table.rank_actions(0, 4, 8) if a.stage == stage]
    assert table.check_plan([1] * 4) is None
    assert table.check_plan([1] * 2) == "the schedule python has 4 stages (on 2 ranks), the plan 2"
    with pytest.raises(ValueError, match="schedule 'gpipe' is not one of several stages per rank"):
        virtual_schedule("gpipe", 2, 4)
    assert virtual_schedule("zbv", 2, 4).placement == (0, 1, 1, 0)
