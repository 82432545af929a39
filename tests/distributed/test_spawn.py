"""A rank that raises or dies fails the run with an error naming it, quickly, leaving no process."""

from __future__ import annotations

import time

import psutil
import pytest
from tp_ranks import die_mid_collective, raise_on_rank

from warmcap.distributed import RankFailedError, rendezvous_for, run_on_ranks


def _children() -> list[psutil.Process]:
    """Live spawned rank processes (multiprocessing's own resource tracker lives as long as this
    process does and is not a rank)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def test_results_come_back_in_rank_order():
    assert run_on_ranks(raise_on_rank, rendezvous_for(2), -1, timeout_s=60) == [0, 1]


def test_a_rank_that_raises_is_named():
    with pytest.raises(RankFailedError, match="rank 1 failed: RuntimeError: deliberate failure") as info:
        run_on_ranks(raise_on_rank, rendezvous_for(2), 1, timeout_s=60)
    assert info.value.rank == 1
    assert not _children()


@pytest.mark.parametrize(
    ("how", "message"), [("exit", "exited with code 17"), ("sigkill", "killed by signal 9")]
)
def test_a_rank_dying_inside_a_collective_fails_fast_with_no_process_left(how, message):
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match=rf"rank 1 failed: its process {message} without a result"):
        run_on_ranks(die_mid_collective, rendezvous_for(2), 1, how, timeout_s=60)
    # Start-up of two spawned interpreters is most of this; the death itself is seen within 0.2 s.
    assert time.monotonic() - t0 < 30
    assert not _children()
