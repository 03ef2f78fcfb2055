import pytest

from pipedream_ft.schedules import from_csv, simulate
from pipedream_ft.schedules.__main__ import main

pytestmark = pytest.mark.timeout(60)


def test_ranking(capsys):
    assert main(["all", "--ranks", "4", "--microbatches", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines]
    assert sorted(names) == sorted(["gpipe", "1f1b", "zb_h1", "pipedream", "interleaved_1f1b",
                                    "interleaved_zero_bubble", "looped_bfs", "zbv", "dualpipev"])
    assert names.index("zb_h1") < names.index("1f1b")  # fastest first
    assert "zb_h1                    step 27, bubble 11.1%, activations held at most 4 microbatches of a rank's share" \
        in lines
    assert main(["all", "--ranks", "4", "--microbatches", "6"]) == 0
    assert "dualpipev                cannot run: DualPipeV needs at least" in capsys.readouterr().out


def test_one_schedule_with_files(tmp_path, capsys):
    assert main(["1f1b", "--ranks", "2", "--microbatches", "2", "--costs", "1,0.5,0.5", "--messages",
                 "--csv", str(tmp_path / "s.csv"), "--trace", str(tmp_path / "s.json")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "rank 0: 0F0 0F1 .   0B0 .   0B1",
        "rank 1: .   1F0 1B0 1F1 1B1 .",
        "step 6, bubble 33.3%, activations held at most 2 microbatches of a rank's share",
    ]
    table = from_csv((tmp_path / "s.csv").read_text())
    assert simulate(table).step_time == 9  # the simulator's default costs: F = I = W = 1
    assert (tmp_path / "s.json").stat().st_size > 0
    assert main([str(tmp_path / "s.csv"), "--costs", "1,0.5,0.5"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("step 6, bubble 33.3%")


@pytest.mark.parametrize("argv,message", [
    (["foo"], "unknown schedule 'foo': expected one of gpipe"),
    (["1f1b", "--costs", "1,2"], "--costs takes F,I,W (three numbers), got '1,2'"),
    (["1f1b", "--costs", "1,-2,1"], "--costs must be finite and >= 0, got '1,-2,1'"),
    (["interleaved_1f1b", "--ranks", "4", "--microbatches", "9"], "multiple of the rounds"),
    (["zbv", "--stages-per-rank", "3"], "schedule 'zbv' runs 2 stage(s) per rank"),
    (["1f1b", "--ranks", "0"], "argument --ranks: count must be at least 1, got '0'"),
])
def test_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("python -m pipedream_ft.schedules: error: ")


def test_bad_table(tmp_path, capsys):
    (tmp_path / "t.csv").write_text("0F0,0B0\n1F1,1B1\n")
    assert main([str(tmp_path / "t.csv")]) == 2
    assert "0B0 on rank 0 needs the gradient of stage 1 for minibatch 0, which no rank computes" \
        in capsys.readouterr().err
