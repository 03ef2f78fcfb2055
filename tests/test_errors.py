"""One-line errors: the line is written whole, even when several ranks write to one pipe at once."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from pipedream_ft.errors import say

_WRITER = """
import sys
from pipedream_ft.errors import say
tag = sys.argv[1]
for i in range(3000):
    say(f"pipedream-ft: rank {tag}: " + tag * 300 + f" {i}")
"""


def test_lines_of_concurrent_writers_never_interleave(tmp_path) -> None:
    """(``print(..., file=sys.stderr, flush=True)`` in the writers garbles hundreds of these lines.)"""
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    r, w = os.pipe()  # one pipe for all, as torchrun's workers share the agent's stderr
    procs = [subprocess.Popen([sys.executable, "-u", str(script), tag], stderr=w) for tag in "abcd"]
    os.close(w)
    with open(r, encoding="utf-8") as f:
        out = f.read()
    for p in procs:
        assert p.wait(timeout=60) == 0
    lines = out.splitlines()
    assert len(lines) == 4 * 3000
    for line in lines:
        head, _, body = line.partition(": rank ")
        tag = body[0]
        assert head == "pipedream-ft" and body == f"{tag}: " + tag * 300 + body[body.rindex(" "):], line[:80]


def test_a_stream_without_a_file_descriptor_gets_the_line() -> None:
    buf = io.StringIO()
    say("pipedream-ft: error: something", buf)
    assert buf.getvalue() == "pipedream-ft: error: something\n"
