"""Workload files: parsed in order, every bad row refused with one line naming it."""

from __future__ import annotations

import pytest

from pipedream_ft.pool import Job, PoolError, find_profiles, read_workload

from pool_helpers import write_chain_profile, write_workload

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def profiles(tmp_path):
    d = tmp_path / "profiles"
    d.mkdir()
    write_chain_profile(d / "m.graph.txt")
    (d / "j.json").write_text("{}")
    (d / "README.md").write_text("not a profile")
    return find_profiles(d)


def test_find_profiles_by_graph_txt_and_json(profiles) -> None:
    assert sorted(profiles) == ["j", "m"]
    assert profiles["m"].name == "m.graph.txt" and profiles["j"].name == "j.json"


def test_a_workload_with_optional_columns(tmp_path, profiles) -> None:
    w = write_workload(tmp_path / "w.csv", ["a,0,m,2,100,1,4,3", "b,5.5,m,1,60,,,"],
                       header="name,time,model,workers,duration,min_workers,max_workers,priority")
    jobs = read_workload(w, profiles, devices=8)
    assert jobs == [Job("a", 0.0, "m", 2, 100.0, 1, 4, 3), Job("b", 5.5, "m", 1, 60.0, None, None, 0)]


@pytest.mark.parametrize("row, said", [
    ("bad-1,5,no_such_model,1,100", "line 3 (bad-1): unknown model 'no_such_model'"),
    ("bad-1,5,m,9,100", "line 3 (bad-1): workers 9 is above the pool's 8 devices"),
    ("bad-1,-5,m,1,100", "line 3 (bad-1): time -5 is negative"),
    ("bad-1,5,m,1,0", "line 3 (bad-1): duration 0 must be > 0"),
    ("bad-1,5,m,1.5,100", "line 3 (bad-1): workers '1.5' is not a whole number"),
    ("bad-1,5,m,1", "line 3 (bad-1): expected 5 fields"),
    ("bad-1,x,m,1,100", "line 3 (bad-1): time 'x' is not a number"),
    ("ok-0,5,m,1,100", "line 3 (ok-0): job name 'ok-0' appears twice"),
])
def test_a_bad_row_is_refused_naming_it(tmp_path, profiles, row: str, said: str) -> None:
    w = write_workload(tmp_path / "w.csv", ["ok-0,0,m,1,100", row])
    with pytest.raises(PoolError) as exc:
        read_workload(w, profiles, devices=8)
    assert said in str(exc.value) and "\n" not in str(exc.value)


def test_bad_files_are_refused(tmp_path, profiles) -> None:
    with pytest.raises(PoolError, match="missing column"):
        read_workload(write_workload(tmp_path / "a.csv", ["a,0,m,1"], header="name,time,model,workers"), profiles)
    with pytest.raises(PoolError, match="no jobs"):
        read_workload(write_workload(tmp_path / "b.csv", []), profiles)
    with pytest.raises(PoolError, match="cannot read"):
        read_workload(tmp_path / "none.csv", profiles)
    with pytest.raises(PoolError, match="min_workers 3 must be >= 1 and <= workers 2"):
        read_workload(write_workload(tmp_path / "c.csv", ["a,0,m,2,10,3,4"],
                                     header="name,time,model,workers,duration,min_workers,max_workers"), profiles)
    with pytest.raises(PoolError, match="not a directory"):
        find_profiles(tmp_path / "nope")
