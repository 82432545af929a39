"""How the ``warmup`` process ends: exit codes and output intact, interpreter teardown skipped."""

from __future__ import annotations

import json
import subprocess
import sys

# Run as the console script does; `Leftover.__del__` runs only if the interpreter tears modules
# down, and the exit handler must run either way.
PRELUDE = """
import atexit, sys, threading, time
class Leftover:
    def __del__(self):
        sys.stderr.write("teardown ran\\n")
leftover = Leftover()
atexit.register(lambda: sys.stderr.write("exit handler ran\\n"))
{extra}
sys.argv = ["warmup", *{args!r}]
from warmcap.cli import main
main()
"""


def _warmup(*args: str, extra: str = "") -> subprocess.CompletedProcess[str]:
    code = PRELUDE.format(args=list(args), extra=extra)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=600
    )


def test_a_finished_command_skips_teardown_but_runs_exit_handlers():
    res = _warmup("--version")
    assert res.returncode == 0 and res.stdout.startswith("warmcap ")
    assert "exit handler ran" in res.stderr
    assert "teardown ran" not in res.stderr


def test_exit_code_and_error_line_of_a_usage_error_are_kept():
    res = _warmup("run", "--model", "tiny-llama", "--quiet", "--verbose")
    assert res.returncode == 2
    assert "--quiet and --verbose" in res.stderr and "Traceback" not in res.stderr
    assert "exit handler ran" in res.stderr


def test_a_command_that_leaves_a_thread_running_exits_the_ordinary_way():
    # NOTE: the thread must outlive the command: `--version` alone takes ~0.5 s here (the import),
    # so a 0.5 s thread raced it on a busy machine.
    res = _warmup("--version", extra="threading.Thread(target=time.sleep, args=(5.0,)).start()")
    assert res.returncode == 0 and res.stdout.startswith("warmcap ")
    assert "exit handler ran" in res.stderr and "teardown ran" in res.stderr


def test_run_json_on_a_pipe_arrives_whole(tmp_path):
    out = tmp_path / "report.json"
    res = _warmup(
        "run",
        "--model",
        "tiny-llama",
        "--spec",
        "none",
        "--max-num-seqs",
        "1",
        "--capture-sizes",
        "1",
        "--no-startup-cache",
        "--json",
        "--out",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == json.loads(out.read_text())
    assert json.loads(res.stdout)["graphs"]
