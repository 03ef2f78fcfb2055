"""A job never loads memory-tier parts it did not write: parts planted at the path the job will use — by
another user (uid 65534, through ``setpriv``) in a directory of theirs, or by this user with another job's key
— are refused, and the job trains on its own weights (bitwise the run without them) instead of resuming from
the planted ones. Real processes and gloo (:func:`dist_helpers.run_world`); the job id is torchrun's
``--rdzv-id`` (``TORCHELASTIC_RUN_ID``) and the secret ``PIPEDREAM_FT_SECRET``, so the test knows the path as
an attacker who knew both would."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

from dist_helpers import run_world
from pipedream_ft.checkpoint.shm import DEFAULT_SHM_ROOT, tier_directory
from pipedream_ft.ft.secret import key_from_secret
from privacy_cases import memory_tier_case

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SECRET = "the job's own secret, 32 chars."
OTHER_SECRET = "another job's secret, 32 chars."
NOBODY = 65534


def run(run_id: str, secret: str, total: int, negate: bool = False) -> dict:
    env = {"TORCHELASTIC_RUN_ID": run_id, "PIPEDREAM_FT_SECRET": secret, "LOCAL_WORLD_SIZE": "2"}
    return run_world(memory_tier_case, 2, total, negate, env=env, timeout=240)[0][1]


def as_nobody(script: str) -> None:
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-ec", script],
                   check=True, timeout=60, capture_output=True)


@pytest.fixture(scope="module")
def planted():
    """Another job's tier under the same job id (other weights, cuts 4 and 8), copied where anyone can read it;
    the path the job under test will use; and the job's uninterrupted run."""
    run_id = f"planted-{uuid.uuid4().hex[:8]}"
    other = run(run_id, OTHER_SECRET, 8, negate=True)
    reference = run(f"reference-{uuid.uuid4().hex[:8]}", SECRET, 16)
    assert other["resumed"] is None and reference["resumed"] is None
    staging = Path(tempfile.mkdtemp(prefix="pdft-planted-"))
    shutil.copytree(other["directory"], staging / "tier", ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(other["directory"])
    shutil.rmtree(reference["directory"])
    for p in [staging, *staging.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    job = os.path.basename(other["directory"])[len("pdft-") + 13:]  # pdft-<12 hex of the key>-<job>
    yield {"run_id": run_id, "job": job, "parts": staging / "tier", "reference": reference["state"],
           "path": tier_directory(job, key_from_secret(SECRET))}
    shutil.rmtree(staging, ignore_errors=True)


def same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_tier_planted_by_another_user_is_refused_and_the_job_trains_on_its_own_weights(planted, capfd):
    path = planted["path"]
    legacy = os.path.join(DEFAULT_SHM_ROOT, f"pdft-{planted['job']}")  # where versions without a key looked
    try:
        for where in (path, legacy):
            as_nobody(f"umask 0; mkdir -m 0777 {where}; cp -r {planted['parts']}/. {where}/")
        capfd.readouterr()
        got = run(planted["run_id"], SECRET, 16)
        err = capfd.readouterr().err
        assert got["resumed"] is None, "the planted cut was loaded"
        assert same(got["state"], planted["reference"])
        lines = [line for line in err.splitlines() if "memory tier" in line]
        assert lines == [f"pipedream-ft: memory tier: {path} is owned by uid {NOBODY}, not by this user (uid 0); "
                         "refusing it; the memory tier is off on this node"], err[-3000:]
    finally:
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(legacy, ignore_errors=True)


def test_parts_of_this_user_without_the_jobs_key_are_ignored_and_the_job_trains_on_its_own_weights(planted, capfd):
    path = planted["path"]
    try:
        shutil.copytree(planted["parts"], path)  # this user's directory; the parts carry another job's MACs
        for p in [Path(path), *Path(path).rglob("*")]:
            p.chmod(0o700 if p.is_dir() else 0o600)
        capfd.readouterr()
        got = run(planted["run_id"], SECRET, 16)
        err = capfd.readouterr().err
        assert got["resumed"] is None, "the planted cut was loaded"
        assert same(got["state"], planted["reference"])
        ignored = [line for line in err.splitlines() if "not signed with this job's key" in line]
        # each rank says once per planted part (its own stage's, at cuts 4 and 8) that it treats it as absent
        assert len(ignored) == 4 and all("(treated as absent)" in line for line in ignored), err[-3000:]
    finally:
        shutil.rmtree(path, ignore_errors=True)
