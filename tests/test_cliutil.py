import argparse

import pytest

from profiler.cliutil import CliError, OneLineParser, number, run_cli, write_atomic

pytestmark = pytest.mark.timeout(30)


def test_number_checks_kind_and_range():
    workers = number("workers", integer=True, low=1)
    assert workers("4") == 4
    for bad, msg in (("x", "whole number"), ("0", "at least 1"), ("1.5", "whole number")):
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            workers(bad)
    bandwidth = number("bandwidth", low=0)
    assert bandwidth("1e9") == 1e9
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            bandwidth(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="at most 10"):
        number("n", high=10)("11")


def test_run_cli_turns_errors_into_one_line(capsys):
    def run(argv):
        p = OneLineParser(prog="tool")
        p.add_argument("--n", type=number("n", integer=True, low=1), required=True)
        p.parse_args(argv)
        raise CliError("it\nbroke")

    assert run_cli("tool", run, ["--n", "0"]) == 2
    assert run_cli("tool", run, ["--n", "2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("tool: error: argument --n: n must be at least 1")
    assert err[1] == "tool: error: it broke"


def test_write_atomic(tmp_path):
    out = tmp_path / "a.json"
    write_atomic(out, "{}")
    assert out.read_text() == "{}"
    with pytest.raises(CliError, match="cannot write"):
        write_atomic(tmp_path / "missing" / "a.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
