"""A training process that failed leaves at once when torchrun ends the group (SIGTERM).

Under torchrun's restart path (no in-place recovery), the survivors of a killed worker fail, print their line and
leave the interpreter, which can take seconds (a process group's pending operations wait for their timeouts);
meanwhile their emergency-checkpoint handler swallowed torchrun's SIGTERM, so torchrun waited for them (~5.8 s
of the restart here). Once training has failed nothing is left to save: SIGTERM must end the process.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(120)

_SCRIPT = """
import atexit, time
import pipedream_ft
from pipedream_ft.errors import PipelineError
from pipedream_ft.policies import PreemptionHandler

def main():
    PreemptionHandler().install()  # as the trainer's checkpointer does
    atexit.register(time.sleep, 300)  # leaving the interpreter is slow
    raise PipelineError("gradient of minibatch 29 with rank 2 failed: Connection reset by peer")

pipedream_ft.launch(main, recovery="restart")
"""


def test_a_failed_process_ends_on_sigterm(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "PIPEDREAM_FT"))}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        seen = ""
        while "Connection reset by peer" not in seen:  # the one line: main has failed
            assert time.monotonic() < deadline and proc.poll() is None, seen
            ready, _, _ = select.select([proc.stderr], [], [], 1.0)
            if ready:
                seen += proc.stderr.readline()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
