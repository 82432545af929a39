"""`warmup run` in a real terminal: the start-up display moves at least every 2 s from its first
frame to its last, while ``--json`` keeps stdout pure JSON (progress goes to the terminal only)."""

from __future__ import annotations

import itertools
import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import warmcap

MAX_GAP_SECONDS = 2.0
SILENT_STEP_SECONDS = 3.0
#: `warmup run` with one step that reports nothing for longer than the bound (the warmup scrub)
SLOW_RUN = f"""
import time
import warmcap.warmup.run as run
scrub = run.scrub
def slow_scrub(*args, **kwargs):
    time.sleep({SILENT_STEP_SECONDS})
    return scrub(*args, **kwargs)
run.scrub = slow_scrub
from warmcap.cli import main
main()
"""


def test_warmup_run_on_a_terminal_redraws_at_least_every_two_seconds_and_json_stays_clean(tmp_path):
    src = str(Path(warmcap.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
        "TERM": "xterm-256color",
        "COLUMNS": "120",
        "WARMCAP_STARTUP_CACHE": str(tmp_path / "cache"),
    }
    args = ["run", "--model", "tiny-llama", "--spec", "none", "--max-num-seqs", "2", "--capture-sizes", "1,2"]
    main, term = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_RUN, *args, "--json"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=term,
        env=env,
    )
    os.close(term)
    frames: list[float] = []
    drawn = b""
    try:
        while True:
            ready, _, _ = select.select([main], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                frames.append(time.monotonic())
                drawn += chunk
            elif proc.poll() is not None:
                break
        stdout = proc.stdout.read()  # type: ignore[union-attr]
        assert proc.wait(timeout=60) == 0, drawn.decode(errors="replace")[-2000:]
    finally:
        os.close(main)
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    text = drawn.decode(errors="replace")
    assert "capture graphs" in text and "verify graphs" in text, text[-2000:]
    gaps = [b - a for a, b in itertools.pairwise(frames)]
    # The silent step alone lasts longer than the bound: only redraws can keep the gaps under it.
    assert frames[-1] - frames[0] > SILENT_STEP_SECONDS
    assert max(gaps) <= MAX_GAP_SECONDS, (max(gaps), len(frames))
    # stdout is the report and nothing else: no frames, no control codes.
    assert b"\x1b" not in stdout
    report = json.loads(stdout)
    assert report["model"] == "tiny-llama" and report["graphs"]
