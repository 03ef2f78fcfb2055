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
