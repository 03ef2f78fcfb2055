"""Per-rank metrics as JSON lines, and the summary table printed at the end of training.

Each rank appends one record per weight update to ``metrics-rank{R}.jsonl``::

    {"rank": 1, "stage": 1, "attempt": 0, "update": 17, "minibatches": 18, "time": 1795324284.05,
     "step_time_s": 0.061, "compute_s": 0.058, "wait_s": 0.002, "bubble_fraction": 0.05,
     "loss": 0.41,                       # last stage only
     "ckpt_snapshot_s": 0.004, "ckpt_persist_s": 0.02, "since_commit_s": 3.1,   # once checkpoints exist
     "restarts": 1, "redone": 6}

``compute_s`` is forward + backward + update time since the previous record, ``wait_s`` the time blocked on
peers, ``bubble_fraction`` the share of the step spent neither computing nor in the optimizer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

__all__ = ["MetricsWriter", "summary_table"]


class MetricsWriter:
    """Appends JSON records to this rank's metrics file, each line with one ``write`` system call on a file opened
    for appending: nothing is buffered in the process, so a process killed at any moment loses at most the line
    being written, and the lines of the processes that take turns on a rank (replacements) never interleave."""

    def __init__(self, directory: str | os.PathLike[str], rank: int) -> None:
        self.path = Path(directory) / f"metrics-rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            raise ValueError(f"metrics file {self.path} is closed")
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        done = os.write(self._fd, line)
        while done < len(line):  # a short write (a full disk, a signal): finish the line
            done += os.write(self._fd, line[done:])

    def flush(self) -> None:
        """Nothing to do: every line is written as it comes (kept for callers that flush)."""

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table, one row per rank: what each stage computed, waited and held."""
    header = ["rank", "stage", "minibatches", "forward s", "backward s", "update s", "wait s", "busy %",
              "stash versions", "stash MiB"]
    lines = []
    for r in rows:
        busy = 100.0 * (r["forward_s"] + r["backward_s"] + r["update_s"]) / r["seconds"] if r.get("seconds") else 0.0
        lines.append([str(r["rank"]), str(r["stage"]), str(r["minibatches"]), f"{r['forward_s']:.2f}",
                      f"{r['backward_s']:.2f}", f"{r['update_s']:.2f}", f"{r['wait_s']:.2f}", f"{busy:.0f}",
                      str(r["peak_stash_versions"]), f"{r['peak_stash_bytes'] / 2**20:.2f}"])
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*l) for l in lines])
