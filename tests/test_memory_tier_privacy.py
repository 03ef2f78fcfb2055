"""The memory tier is private to its job: a tier directory or part planted by another user (a real other uid,
through ``setpriv``), or a part written without the job's key, is never used; the tier's files are 0700/0600;
the last process of a job to leave removes the tier; a new job reclaims the tiers of this user's jobs that are
gone, and of failed starts, but never a tier a live process holds or another user's.

The tests run as root, whom the kernel's permission checks do not stop: the tier's own owner and mode checks are
what must refuse another user's files.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pipedream_ft.checkpoint import (
    CheckpointWriter,
    CorruptCheckpointError,
    DurableTier,
    MemoryTier,
    Storage,
    TierWriter,
    load_newest,
)
from pipedream_ft.checkpoint.checksum import checksum
from pipedream_ft.checkpoint.shm import UntrustedTierError, reclaim_stale, tier_directory
from pipedream_ft.ft.secret import key_from_secret, reclaim_stale_keys

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
KEY = key_from_secret("this job's secret, long enough")
OTHER_KEY = key_from_secret("another job's secret, as long")
NOBODY = 65534


def as_nobody(script: str) -> None:
    """Run a shell script as another user (uid/gid 65534, no supplementary groups)."""
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-ec", script],
                   check=True, timeout=60, capture_output=True)


@pytest.fixture
def shm():
    """A directory like /dev/shm: every user may create names in it (mode 1777)."""
    root = tempfile.mkdtemp(prefix="pdft-privacy-test-")
    os.chmod(root, 0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def state_of(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 8, generator=g), "step": step}


def python(code: str, *args: str) -> subprocess.Popen:
    prelude = f"import sys, os, time, signal\nsys.path.insert(0, {str(ROOT)!r})\nKEY = {KEY!r}\n"
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.PIPE, text=True)


def test_the_tier_is_created_private(shm) -> None:
    tier = MemoryTier("job", key=KEY, root=shm)
    tier.put(4, "a", b"data", checksum([b"data"]))
    modes = {p.relative_to(tier.directory).as_posix(): stat.S_IMODE(p.lstat().st_mode)
             for p in Path(tier.directory).rglob("*")}
    assert stat.S_IMODE(os.stat(tier.directory).st_mode) == 0o700
    assert modes == {".lock": 0o600, "step-0000000004": 0o700, "step-0000000004/part-a.pt": 0o600,
                     "step-0000000004/part-a.json": 0o600}
    # the path is not guessable without the key
    assert tier.directory == tier_directory("job", KEY, shm) != tier_directory("job", OTHER_KEY, shm)
    tier.destroy()


def test_a_tier_directory_planted_by_another_user_is_refused(shm) -> None:
    path = tier_directory("job", KEY, shm)
    # another user creates the tier's directory first, open to everybody, with a part in it
    as_nobody(f"umask 0; mkdir -m 0777 {path} {path}/step-0000000008; echo planted > {path}/step-0000000008/part-a.pt")
    assert os.stat(path).st_uid == NOBODY
    with pytest.raises(UntrustedTierError, match=f"{path} is owned by uid {NOBODY}, not by this user"):
        MemoryTier("job", key=KEY, root=shm)
    # a symlink planted by another user to a directory of ours is refused too (never followed)
    mine = tempfile.mkdtemp(dir=shm)
    link = tier_directory("linked", KEY, shm)
    as_nobody(f"ln -s {mine} {link}")
    with pytest.raises(UntrustedTierError, match="is not a regular directory"):
        MemoryTier("linked", key=KEY, root=shm)
    # ours, but writable by everybody: refused as well
    open_dir = tier_directory("open", KEY, shm)
    os.mkdir(open_dir)
    os.chmod(open_dir, 0o777)
    with pytest.raises(UntrustedTierError, match=r"writable by group or others \(mode 0777\)"):
        MemoryTier("open", key=KEY, root=shm)


def test_a_part_of_another_user_or_without_the_jobs_key_counts_as_absent(shm, tmp_path, caplog) -> None:
    storage = Storage(str(tmp_path / "durable"))
    durable = CheckpointWriter(storage, "a", is_committer=True, poll_interval_s=0.005)
    durable.save(10, state_of(10))
    assert durable.flush(30)
    durable.close()
    tier = MemoryTier("job", key=KEY, root=shm)
    writer = TierWriter([tier], "a", keep=5)
    writer.save(12, state_of(12))
    assert writer.flush(30)
    # another job of this user (another key) wrote step 14 in this directory: a valid part, but not this job's
    foreign = MemoryTier("x", key=OTHER_KEY, root=shm, reclaim_after_s=None)
    TierWriter([foreign], "a", keep=5).save(14, state_of(99)).wait(30)
    shutil.copytree(Path(foreign.directory) / "step-0000000014", Path(tier.directory) / "step-0000000014")
    # another user's part at step 16 (a copy of a genuine part, so only its owner tells it apart)
    writer.save(16, state_of(16))
    assert writer.flush(30)
    for f in (Path(tier.directory) / "step-0000000016").iterdir():
        os.chown(f, NOBODY, NOBODY)
    with caplog.at_level(logging.WARNING, logger="pipedream_ft.checkpoint"):
        assert tier.steps(["a"]) == [12]
        assert tier.steps(["a"]) == [12]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # once per part
    assert any("step 14: its record is not signed with this job's key" in w for w in warnings), warnings
    assert any(f"part-a.json is owned by uid {NOBODY}" in w for w in warnings), warnings
    # genuine record, changed bytes (same size): the MAC rejects them; the restore falls back to the durable tier
    data = Path(tier.directory) / "step-0000000012" / "part-a.pt"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="do not match their MAC under this job's key"):
        tier.get(12, "a")
    step, name, got = load_newest([tier, DurableTier(storage)], "a", [10, 12])  # type: ignore[misc]
    assert (step, name) == (10, "durable") and torch.equal(got["w"], state_of(10)["w"])
    writer.close()


def test_the_last_process_to_leave_removes_the_tier(shm) -> None:
    holder = python("""
from pipedream_ft.checkpoint import MemoryTier
tier = MemoryTier("job", key=KEY, root=sys.argv[1])
print(tier.directory, flush=True)
sys.stdin.readline()
print(tier.leave(), flush=True)
""", shm)
    try:
        directory = holder.stdout.readline().strip()  # type: ignore[union-attr]
        mine = MemoryTier("job", key=KEY, root=shm)
        assert mine.directory == directory
        assert mine.leave() is False and os.path.isdir(directory)  # the other process still holds it
        out, err = holder.communicate("\n", timeout=60)
        assert holder.returncode == 0 and out.split() == ["True"], err
        assert not os.path.exists(directory)
    finally:
        if holder.poll() is None:
            holder.kill()


def test_a_new_job_reclaims_the_tiers_of_this_users_jobs_that_are_gone(shm) -> None:
    live = python("""
from pipedream_ft.checkpoint import MemoryTier
tier = MemoryTier("live-job", key=KEY, root=sys.argv[1])
tier.put(8, "a", b"live", "crc32:00000000")
print(tier.directory, flush=True)
sys.stdin.readline()
""", shm)
    dead = python("""
from pipedream_ft.checkpoint import MemoryTier
tier = MemoryTier("dead-job", key=KEY, root=sys.argv[1])
tier.put(8, "a", b"x" * 1000, "crc32:00000000")
print(tier.directory, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
""", shm)
    try:
        live_dir = live.stdout.readline().strip()  # type: ignore[union-attr]
        dead_out, _ = dead.communicate(timeout=60)
        dead_dir = dead_out.strip()
        assert dead.returncode == -signal.SIGKILL and os.path.isdir(dead_dir)
        failed_start = os.path.join(shm, "pdft-failed-start")  # an empty directory, no lock
        os.mkdir(failed_start)
        others = os.path.join(shm, "pdft-another-users-job")
        as_nobody(f"mkdir -m 0700 {others}")
        recent = MemoryTier("recent-job", key=KEY, root=shm, reclaim_after_s=None)
        recent.close()  # gone, but within the grace period (torchrun may be restarting it)
        old = time.time() - 3600
        for d in (live_dir, dead_dir, failed_start, others):
            os.utime(d, (old, old))
        tier = MemoryTier("new-job", key=KEY, root=shm, reclaim_after_s=600)
        left = sorted(os.listdir(shm))
        assert left == sorted(os.path.basename(d) for d in (live_dir, others, recent.directory, tier.directory))
        assert os.path.exists(os.path.join(live_dir, "step-0000000008", "part-a.json"))
        live.communicate("\n", timeout=60)  # the live job's process ends without leaving (killed, say)
        assert reclaim_stale(shm, older_than_s=600) == [live_dir]
    finally:
        for p in (live, dead):
            if p.poll() is None:
                p.kill()


def test_key_files_of_jobs_that_are_gone_are_reclaimed(tmp_path) -> None:
    from pipedream_ft.ft.secret import job_secret

    keys = tmp_path / "keys"
    holder = python("""
from pipedream_ft.ft.secret import job_secret
key = job_secret(job_id="held", store=None, single_node=True, secret="", key_dir=sys.argv[1])
print(key.hex(), flush=True)
sys.stdin.readline()
""", str(keys))
    try:
        held = bytes.fromhex(holder.stdout.readline().strip())  # type: ignore[union-attr]
        # the same job's other processes get the same key; another job gets another one
        assert job_secret(job_id="held", store=None, single_node=True, secret="", key_dir=str(keys)) == held
        assert stat.S_IMODE(keys.stat().st_mode) == 0o700 and stat.S_IMODE((keys / "held.key").stat().st_mode) == 0o600
        gone = python("""
from pipedream_ft.ft.secret import job_secret
job_secret(job_id="gone", store=None, single_node=True, secret="", key_dir=sys.argv[1])
""", str(keys))
        assert gone.wait(60) == 0
        old = time.time() - 3600
        for name in ("held.key", "gone.key"):
            os.utime(keys / name, (old, old))
        assert reclaim_stale_keys(str(keys), older_than_s=600) == [str(keys / "gone.key")]
    finally:
        holder.kill()
        holder.communicate(timeout=10)
