"""Building a CPU kernel once per machine (``kernels/cpu/build.py``): processes that start together
(tensor-parallel ranks) build one library under a file lock and all load it; a failed build is
recorded in the cache, reported by the process that tried it, and not retried by the others."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from warmcap.kernels.cpu import build
from warmcap.kernels.cpu.paged_attention import ENV

#: one process of a TP group: the attention kernel in auto mode, its log on stderr
RANK = textwrap.dedent(
    """
    import logging
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    from warmcap.kernels.cpu.paged_attention import load_paged_attention
    print("kernel" if load_paged_attention() is not None else "fallback")
    """
)


def spy_compiler(tmp_path: Path, *, fails: bool) -> tuple[Path, Path]:
    """A ``CC`` that appends a line to a log for every compile (``-c``; not for the link step or
    ``-dumpfullversion``), takes a second (so two processes starting together overlap), then runs
    the real compiler or fails."""
    real = build.compiler()
    assert real is not None, "these tests need the system C compiler"
    log = tmp_path / "compiles.log"
    cc = tmp_path / "cc"
    run = (
        'echo "error: the spy compiler fails" >&2; exit 1'
        if fails
        else f'exec {shutil.which(real) or real} "$@"'
    )
    cc.write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" -c "*) ;; *) exec {real} "$@" ;; esac\n'
        f'echo compile >> "{log}"\n'
        "sleep 1\n"
        f"{run}\n"
    )
    cc.chmod(0o755)
    return cc, log


def ranks(n: int, tmp_path: Path, cc: Path) -> list[subprocess.CompletedProcess]:
    """``n`` processes started together on one cache; their results once all have finished."""
    env = {**os.environ, "WARMCAP_CACHE": str(tmp_path / "cache"), "CC": str(cc)}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    env.pop(ENV, None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(n)
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def compiles(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.mark.slow
def test_two_processes_building_at_once_build_one_library_and_both_load_it(tmp_path):
    cc, log = spy_compiler(tmp_path, fails=False)
    done = ranks(2, tmp_path, cc)
    for d in done:
        assert d.returncode == 0, d.stderr[-3000:]
        assert d.stdout.split() == ["kernel"], d.stderr[-3000:]
    assert compiles(log) == 1, "the second process must wait for the first one's build"
    assert len(list((tmp_path / "cache" / "kernels").glob("paged_attention-*.so"))) == 1


@pytest.mark.slow
def test_a_failed_build_is_reported_once_per_machine_and_not_retried(tmp_path):
    cc, log = spy_compiler(tmp_path, fails=True)
    first = ranks(2, tmp_path, cc)
    later = ranks(1, tmp_path, cc)
    for d in first + later:
        assert d.returncode == 0, d.stderr[-3000:]
        assert d.stdout.split() == ["fallback"]
    assert compiles(log) == 1, "one compile for the machine: the failure is recorded, not retried"
    warnings = [line for d in first + later for line in d.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "error: the spy compiler fails" in warnings[0], warnings
    # The others say where the failure is recorded (INFO), and how to try again.
    for d in first + later:
        if not any(line.startswith("WARNING") for line in d.stderr.splitlines()):
            assert "an earlier build on this machine; delete" in d.stderr and ".failed" in d.stderr
    records = list((tmp_path / "cache" / "kernels").glob("paged_attention-*.failed"))
    assert len(records) == 1 and not list((tmp_path / "cache" / "kernels").glob("*.so"))


def test_kernel_mode_refuses_a_recorded_failure_with_its_reason(monkeypatch, tmp_path):
    """The recorded failure is a failure in ``kernel`` mode too, with the compiler's message;
    deleting the record builds again."""
    from warmcap.errors import ConfigError
    from warmcap.kernels.cpu.paged_attention import load_paged_attention

    cc, log = spy_compiler(tmp_path, fails=True)
    monkeypatch.setenv("WARMCAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv(ENV, "kernel")
    for _ in range(2):
        with pytest.raises(ConfigError, match="the spy compiler fails"):
            load_paged_attention()
    assert compiles(log) == 1
    (record,) = (tmp_path / "cache" / "kernels").glob("*.failed")
    record.unlink()
    with pytest.raises(ConfigError, match="the spy compiler fails"):
        load_paged_attention()
    assert compiles(log) == 2, "without the record the build is tried again"
