"""Run one function on every rank of a fresh tensor-parallel group, each rank its own process.

Each rank joins the group (:mod:`warmcap.distributed.rendezvous`), runs ``fn(rank, *args)`` and
reports its result or its error through a queue. The parent watches the processes: a rank that
raises, or dies without reporting (killed, crashed), fails the whole run with a
:class:`RankFailedError` naming it, within ``poll_s`` of the death; every process still alive is
then terminated, so nothing is left behind.
"""

from __future__ import annotations

import io
import queue as queue_mod
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from warmcap.distributed.rendezvous import DEFAULT_COLLECTIVE_TIMEOUT_S, Rendezvous, join_group, leave_group
from warmcap.errors import WarmcapError
from warmcap.kernels.cpu.threads import BIND_AUTO, prefer_yielding_wait, start_threads

#: how often the parent checks that every rank is alive
POLL_S = 0.2
#: how long a rank's error waits for evidence that a peer died first (the likelier cause)
DEATH_GRACE_S = 1.0
#: how long a terminated rank gets to exit before it is killed
TERMINATE_GRACE_S = 5.0


class RankFailedError(WarmcapError):
    """A tensor-parallel rank raised or died; the message names the rank and what happened."""

    def __init__(self, rank: int, what: str) -> None:
        super().__init__(f"tensor-parallel rank {rank} failed: {what}")
        self.rank = rank


def _rank_main(
    rank: int,
    rendezvous: Rendezvous,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    try:
        # Every rank a share of the cores (gloo: the ranks share this machine's CPU), pinned.
        if rendezvous.backend == "gloo":
            threads = start_threads("cpu", None, BIND_AUTO, rank=rank, world_size=rendezvous.world_size)
            if threads is not None:
                threads.pin_team()
        join_group(rank, rendezvous, timeout_s=timeout_s)
        try:
            out = fn(rank, *args)
        finally:
            leave_group()
    # Anything, SystemExit included, is reported to the parent, which raises it naming this rank.
    except BaseException as e:
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    # NOTE: pickled to bytes here: torch.multiprocessing would pass tensors as shared-memory file
    # descriptors, which vanish when this process exits before the parent has read them.
    buf = io.BytesIO()
    torch.save(out, buf)
    results.put((rank, True, buf.getvalue()))


def run_on_ranks(
    fn: Callable[..., Any],
    rendezvous: Rendezvous,
    *args: Any,
    timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
) -> list[Any]:
    """``[fn(0, *args), ..., fn(N-1, *args)]``, each run in its own spawned process as that rank.

    ``fn`` must be importable by name (a module-level function) and its results picklable.
    Raises :class:`RankFailedError` for the first rank that raises or dies, or when the ranks
    together take longer than ``timeout_s``.
    """
    # NOTE: the ranks are fresh processes: their OpenMP runtime starts with this environment.
    prefer_yielding_wait()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, rendezvous, timeout_s, fn, args, results),
            name=f"warmcap-tp-rank{rank}",
            daemon=True,
        )
        for rank in range(rendezvous.world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, timeout_s)
    finally:
        stop_processes(procs)
        results.close()


def _collect(procs: list[Any], results: Any, timeout_s: float) -> list[Any]:
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(procs):
        try:
            rank, ok, value = results.get(timeout=POLL_S)
        except queue_mod.Empty:
            dead = _silently_dead(procs, done)
            if dead is not None:
                raise RankFailedError(dead, describe_exit(procs[dead])) from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(done))
                raise RankFailedError(missing[0], f"no result within {timeout_s:.0f} s") from None
            continue
        if not ok:
            # A rank whose peer died fails inside a collective a moment later ("connection reset"):
            # the death is the cause, so wait briefly for one before blaming the rank that reported.
            grace_end = time.monotonic() + DEATH_GRACE_S
            while time.monotonic() < grace_end:
                dead = _silently_dead(procs, {**done, rank: None})
                if dead is not None:
                    raise RankFailedError(
                        dead,
                        f"{describe_exit(procs[dead])} (rank {rank} then failed: {value.splitlines()[0]})",
                    )
                time.sleep(POLL_S / 4)
            raise RankFailedError(rank, value)
        done[rank] = torch.load(io.BytesIO(value), weights_only=False)
    return [done[r] for r in range(len(procs))]


def _silently_dead(procs: list[Any], reported: dict[int, Any]) -> int | None:
    """The first rank whose process exited without reporting, if any."""
    for rank, p in enumerate(procs):
        if rank not in reported and not p.is_alive() and p.exitcode not in (None, 0):
            return rank
    return None


def describe_exit(proc: Any) -> str:
    """How a rank's process ended, for an error message (``killed by signal 9``, ``exited with code 1``)."""
    code = proc.exitcode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    return f"its process {how} without a result"


def stop_processes(procs: list[Any], *, grace_s: float = 0.0) -> None:
    """Make sure every process in ``procs`` has ended: each gets ``grace_s`` to exit on its own,
    then is terminated, then (after ``TERMINATE_GRACE_S``) killed. Processes never started are skipped."""
    procs = [p for p in procs if p.pid is not None]
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + TERMINATE_GRACE_S
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
