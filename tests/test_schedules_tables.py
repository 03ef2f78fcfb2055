import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipedream_ft.schedules import (Action, Kind, add_communication, build, from_csv, load_csv, save_csv, simulate,
                                    to_csv)

pytestmark = pytest.mark.timeout(60)

cells = st.one_of(st.none(), st.builds(Action, stage=st.integers(0, 99), kind=st.sampled_from(list(Kind)),
                                       index=st.integers(0, 999)))


def test_literal_table():
    sched, _ = build("1f1b", 2, 2)
    assert to_csv(sched) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    text = "0F0,,0I0,0W0\n,1F0,1I0,1W0\n"
    table = from_csv(text)
    assert table == {0: [Action(0, Kind.F, 0), None, Action(0, Kind.I, 0), Action(0, Kind.W, 0)],
                     1: [None, Action(1, Kind.F, 0), Action(1, Kind.I, 0), Action(1, Kind.W, 0)]}
    assert to_csv(table) == text
    assert simulate(table).step_time == 5  # idle cells are only slots: the run waits on data, not on them


@given(st.lists(st.lists(cells, max_size=12), min_size=1, max_size=6))
def test_round_trip(rows):
    sched = dict(enumerate(rows))
    assert from_csv(to_csv(sched)) == sched


@pytest.mark.parametrize("name", ["zb_h1", "interleaved_1f1b", "dualpipev"])
def test_file_round_trip_with_messages(tmp_path, name):
    sched, placement = build(name, 3, 6)
    lowered = add_communication(sched, placement)
    save_csv(lowered, tmp_path / "s.csv")
    assert load_csv(tmp_path / "s.csv") == lowered
    assert simulate(load_csv(tmp_path / "s.csv")).step_time == simulate(sched).step_time


def test_bad_cells_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"row 1 \(rank 1\), column 2: bad action '1Q0'"):
        from_csv("0F0,0B0\n1F0,1B0,1Q0\n")
    (tmp_path / "bad.csv").write_text("0F0,F1\n")
    with pytest.raises(ValueError, match=r"bad.csv: row 0 \(rank 0\), column 1: bad action 'F1'"):
        load_csv(tmp_path / "bad.csv")
    with pytest.raises(ValueError, match=r"a table holds ranks 0..R-1, the schedule has ranks \[0, 2\]"):
        to_csv({0: [], 2: []})
