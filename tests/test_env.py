"""Everything read from the environment, in one place (pipedream_ft/env.py)."""

from __future__ import annotations

import pytest

from pipedream_ft.env import SETTINGS, DistEnv, read_env, setting


def test_torchrun_variables_become_a_dist_env_and_keywords_override_them():
    env = read_env({"RANK": "2", "WORLD_SIZE": "4", "MASTER_PORT": "1234", "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "PIPEDREAM_FT_RECOVERY": "in-place", "RUNTIME_NOISE": "x"})
    assert (env.rank, env.world_size, env.master_port, env.use_agent_store, env.recovery) == (2, 4, 1234, True,
                                                                                              "in-place")
    assert read_env({"RANK": "2", "WORLD_SIZE": "4"}, rank=1).rank == 1
    assert read_env({}) == DistEnv()
    with pytest.raises(ValueError, match="environment variable RANK='two' is not valid"):
        read_env({"RANK": "two"})
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\), got 4"):
        read_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(TypeError, match="unknown DistEnv fields"):
        read_env({}, ranks=3)


def test_settings_are_read_by_name_in_one_place():
    assert setting("PIPEDREAM_FT_TRACE_DIR", {"PIPEDREAM_FT_TRACE_DIR": "/tmp/t"}) == "/tmp/t"
    assert setting("PIPEDREAM_FT_TRACE_DIR", {"PIPEDREAM_FT_TRACE_DIR": ""}) is None  # empty is unset
    assert setting("PIPEDREAM_FT_TRACE_DIR", {}) is None
    assert "PIPEDREAM_FT_FAULTS" in SETTINGS
    with pytest.raises(KeyError, match="unknown setting 'PIPEDREAM_FT_TRACEDIR'"):
        setting("PIPEDREAM_FT_TRACEDIR", {})


def test_a_supervisor_hands_its_child_a_dist_env_instead_of_writing_the_environment(monkeypatch):
    import os

    from pipedream_ft import env as env_mod
    from pipedream_ft.env import hand_over, requested_recovery

    monkeypatch.setattr(env_mod, "_handed", None)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    before = dict(os.environ)
    handed = DistEnv(rank=1, world_size=2, recovery="in-place", incarnation=3, live_round="r7", supervisor="s1")
    hand_over(handed)
    assert read_env() is handed
    assert read_env(incarnation=4).incarnation == 4 and read_env().incarnation == 3
    assert read_env({"RANK": "0"}).rank == 0  # an explicit mapping is still read as given
    with pytest.raises(TypeError, match="unknown DistEnv fields"):
        read_env(ranks=3)
    assert dict(os.environ) == before  # nothing written
    with pytest.raises(TypeError, match="hand_over needs a DistEnv or None, got dict"):
        hand_over({"rank": 1})
    hand_over(None)
    assert read_env() == read_env(dict(os.environ)) and read_env().incarnation == 0
    assert requested_recovery({}) is None and requested_recovery({"PIPEDREAM_FT_RECOVERY": ""}) is None
    assert requested_recovery({"PIPEDREAM_FT_RECOVERY": "restart"}) == "restart"
