"""One line and the error's own exit status (pipedream_ft/reporting.py): set-up errors the same on every rank, runtime
failures from every rank, anything else propagates."""

from __future__ import annotations

import pytest
from torch.distributed import DistError

from partitioner.plan import PlanError
from pipedream_ft.checkpoint import CheckpointError
from pipedream_ft.crashlog import log_dir
from pipedream_ft.env import read_env
from pipedream_ft.errors import (EXIT_PREEMPTED, EXIT_RECOVERY_FAILED, EXIT_REPLAN, EXIT_RUNTIME, EXIT_SETUP, JobError,
                                 PipelineError, PipelineSetupError)
from pipedream_ft.ft.checkpointer import Preempted
from pipedream_ft.ft.recovery import RecoveryFailed
from pipedream_ft.ft.replan import RePlanned
from pipedream_ft.pipeline.comm import PeerTimeoutError, ShapeMismatchError
from pipedream_ft.reporting import exit_code_of, exit_on_error, run_reporting_errors
from profiler.profile import ProfileError

pytestmark = pytest.mark.timeout(30)

CODES = [(PipelineSetupError("bad plan"), EXIT_SETUP), (JobError("source ended"), EXIT_SETUP),
         (PlanError("no plan"), EXIT_SETUP), (ProfileError("no profile"), EXIT_SETUP),
         (CheckpointError("no storage"), EXIT_SETUP), (ShapeMismatchError("shapes"), EXIT_SETUP),
         (PipelineError("lost"), EXIT_RUNTIME), (PeerTimeoutError("peer 2 silent"), EXIT_RUNTIME),
         (DistError("store gone\nmore"), EXIT_RUNTIME), (Preempted("SIGTERM"), EXIT_PREEMPTED),
         (RecoveryFailed("no quorum"), EXIT_RECOVERY_FAILED), (RePlanned("better plan"), EXIT_REPLAN)]


@pytest.mark.parametrize("exc,code", CODES, ids=lambda x: type(x).__name__ if isinstance(x, BaseException) else "")
@pytest.mark.parametrize("rank", ["0", "3"])
def test_each_error_carries_its_status_and_says_one_line(exc, code, rank, monkeypatch, capsys):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "4")

    def fail():
        raise exc

    assert exit_code_of(exc) == code
    assert run_reporting_errors(fail) == (code, None)
    lines = capsys.readouterr().err.splitlines()
    if code == EXIT_SETUP:  # the same line on every rank, naming where the tracebacks are
        assert lines == [f"pipedream-ft: error: {exc} (tracebacks in {log_dir(read_env())})"]
    elif isinstance(exc, DistError):
        assert lines == [f"pipedream-ft: rank {rank}: DistError: store gone"]
    else:
        assert lines == [f"pipedream-ft: rank {rank}: {exc}"]


def test_the_rank_is_reported_from_rank_alone(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # the rest of the environment need not be whole

    def fail():
        raise PipelineError("lost")

    assert run_reporting_errors(fail) == (EXIT_RUNTIME, None)
    assert capsys.readouterr().err == "pipedream-ft: rank 3: lost\n"


def test_results_pass_through_and_other_errors_propagate(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert run_reporting_errors(lambda x: x + 1, 41) == (0, 42)
    assert exit_code_of(KeyError("x")) is None

    def boom():
        raise KeyError("user bug")

    with pytest.raises(KeyError, match="user bug"):
        run_reporting_errors(boom)


def test_exit_on_error_exits_with_the_status(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")

    def fail():
        raise RecoveryFailed("rank 2 never came back")

    with pytest.raises(SystemExit) as info:
        exit_on_error(fail)
    assert info.value.code == EXIT_RECOVERY_FAILED
    assert capsys.readouterr().err == "pipedream-ft: rank 0: rank 2 never came back\n"
    assert exit_on_error(lambda: "done") == "done"
