"""Tensor-parallel ranks of one machine share memory: the model's collectives give gloo's bits, rank
0's commands arrive in order whatever their size, the engine generates TP=1's tokens, and a killed
rank ends the engine at once leaving no segment in /dev/shm."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from tp_ranks import shm_commands, shm_vs_gloo

from warmcap.distributed import rendezvous_for, run_on_ranks
from warmcap.distributed.shm_segment import PREFIX, SHM_DIR
from warmcap.llm import LLM
from warmcap.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 7, 41], [300, 12], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SMALL = {"max_model_len": 128, "max_num_seqs": 4, "enforce_eager": True}


def _segments(pid: int) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"{PREFIX}{pid}-*"))


def test_shm_collectives_give_gloos_bits_on_every_rank():
    ranks = run_on_ranks(shm_vs_gloo, rendezvous_for(2), timeout_s=120)
    for rank, out in enumerate(ranks):
        assert out["transport"] == "shm", rank
        assert out["compiled"], rank  # float32 all-reduces went through the C collective
        for case, (shm, gloo) in out["reduce"].items():
            assert shm.dtype == gloo.dtype and shm.equal(gloo), (rank, case)
        for case, (shm, gloo) in out["gather"].items():
            assert shm.equal(gloo), (rank, case)
    # Every rank holds the same sums, bit for bit.
    for case in ranks[0]["reduce"]:
        assert ranks[0]["reduce"][case][0].equal(ranks[1]["reduce"][case][0]), case
    assert not _segments(os.getpid())


def test_commands_arrive_in_order_through_the_ring_and_the_oversize_fallback():
    sent, got = run_on_ranks(shm_commands, rendezvous_for(2), timeout_s=120)
    assert sent["transport"] == got["transport"] == "shm"
    assert got["received"] == sent["received"]
    # More messages than ring slots, and some larger than a slot (they take the gloo broadcast).
    assert len(sent["received"]) > 8 and any(
        isinstance(m, bytes) and len(m) > 300_000 for m in sent["received"]
    )


def _run(tp: int, tp_comm: str | None = None, **env: str) -> list[list[int]]:
    """Tokens of ``PROMPTS`` at ``tp`` ranks, the transport chosen by the ``tp_comm`` option or by
    ``$WARMCAP_TP_COMM`` (its default)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        llm = LLM("tiny-llama", tensor_parallel_size=tp, tp_comm=tp_comm, **SMALL)
        try:
            if tp > 1:
                wanted = tp_comm or env.get("WARMCAP_TP_COMM", "shm")
                assert llm.engine.executor.channel.transport == wanted
            return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
        finally:
            llm.shutdown()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.slow
def test_tp2_over_shared_memory_generates_what_tp1_and_gloo_generate():
    one = _run(1)
    assert _run(2, WARMCAP_TP_COMM="shm") == one
    assert _run(2, WARMCAP_TP_COMM="gloo") == one
    # The option wins over the variable: the config says which collectives ran.
    assert _run(2, tp_comm="gloo", WARMCAP_TP_COMM="shm") == one
    assert not _segments(os.getpid())


CLI = [sys.executable, "-c", "from warmcap.cli import main; main()"]
LONG = ["generate", "-m", "tiny-llama", "-tp", "2", "--prompt", "The quick brown fox", "--no-chat"]
LONG += ["--max-tokens", "1000", "--no-audit", "-q"]
#: eager steps (the all-reduce called from Python), or recorded graphs replaying it as a C call
MODES = {"eager": ["--enforce-eager"], "recorded": []}


def test_tp2_graphs_record_their_all_reduces_and_generate_tp1s_tokens():
    """With the shared-memory all-reduce in C, a tensor-parallel rank's graphs record (none runs
    its forward again at replay) and the tokens are TP=1's."""
    graphed = {k: v for k, v in SMALL.items() if k != "enforce_eager"}
    llm = LLM("tiny-llama", tensor_parallel_size=2, **graphed)
    try:
        graphs = [
            g for by_descriptor in llm.engine.runner.graphs._graphs.values() for g in by_descriptor.values()
        ]
        assert graphs and all(g.program is not None for g in graphs), [g.not_recorded for g in graphs]
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        replays = sum(llm.engine.runner.graphs.replays.values())
    finally:
        llm.shutdown()
    assert replays > 0
    assert got == _run(1)


def _started_cli(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, int, Path]:
    """The CLI generating 1000 tokens at TP=2 (``mode``: eager or with recorded graphs), once the
    first have come (so its worker is stepping)."""
    log = tmp_path / "cli.log"
    proc = subprocess.Popen([*CLI, *LONG, *MODES[mode]], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the worker never started generating"
            workers = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in _cmdline(c)]
            if workers and log.read_text().strip():
                maps = Path(f"/proc/{workers[0].pid}/maps").read_text()
                # Unlinked once mapped: the mapping is all that is left of the name.
                assert re.search(rf"/dev/shm/{PREFIX}{proc.pid}-\w+ \(deleted\)", maps), maps[-2000:]
                return proc, workers[0].pid, log
            time.sleep(0.05)
    except BaseException:
        # A helper that failed must not leave the CLI and its worker behind for the next test.
        proc.kill()
        proc.wait()
        raise


def _cmdline(process: psutil.Process) -> str:
    """A child's command line; "" for one that has just exited (a zombie not yet reaped, or gone)."""
    try:
        return " ".join(process.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return ""


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_killed_worker_ends_the_cli_at_once_with_one_line_and_no_segment(tmp_path, mode):
    proc, worker, log = _started_cli(tmp_path, mode)
    try:
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(60)
        took = time.monotonic() - killed
    finally:
        proc.kill()
        proc.wait()
    out = log.read_text()
    assert code == 2, out[-3000:]
    # One line of its own, after the text streamed so far.
    assert any(
        line.startswith("error: tensor-parallel rank 1 failed: its process killed by signal 9")
        for line in out.splitlines()
    ), out[-3000:]
    assert "Traceback" not in out
    # Python's exit (the interpreter tearing down torch) is part of this; the failure itself is seen
    # within the waits' 10 ms peer check.
    assert took < 5.0, f"the CLI took {took:.1f} s to exit"
    assert not _segments(proc.pid)


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_killed_rank0_leaves_no_worker_and_no_segment(tmp_path, mode):
    proc, worker, _log = _started_cli(tmp_path, mode)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # The worker, waiting on rank 0 in shared memory, sees it gone and exits by itself.
    psutil.Process(worker).wait(10)
    assert not _segments(proc.pid)
