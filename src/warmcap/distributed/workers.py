"""How rank 0 watches its worker ranks, and how a worker tells rank 0 that it failed.

Two ways a group comes to exist, one watch for each:

- :class:`SpawnedWorkers`: rank 0 spawned ranks 1..N-1 on its own machine
  (:meth:`~warmcap.distributed.executor.TPExecutor.start` without ``RANK``). It holds their process
  handles, so a death is seen with its exit status, and each worker's error arrives on a queue.
- :class:`LaunchedWorkers`: a launcher started every rank itself (``RANK`` set,
  :mod:`warmcap.distributed.launch`), possibly on other machines. Rank 0 has no handle on them, so
  they report through the group's store (:func:`~warmcap.distributed.rendezvous.group_store`):
  an error under ``warmcap/error/<rank>`` and a heartbeat counter under ``warmcap/beat/<rank>``
  that :class:`Heartbeat` bumps every :data:`HEARTBEAT_S`. A rank whose counter stops moving for
  :data:`STALE_S` is the one that died. Counters rather than timestamps: clocks on two machines
  need not agree.

Either watch answers the same questions for the executor: did a worker report an error, which
worker died, and stop them all.
"""

from __future__ import annotations

import contextlib
import logging
import queue as queue_mod
import threading
import time
from typing import Any, Protocol

import torch.distributed as dist

from warmcap.distributed.rendezvous import group_store
from warmcap.distributed.spawn import POLL_S, RankFailedError, describe_exit, stop_processes

logger = logging.getLogger("warmcap.distributed")

#: how often a launched worker bumps its heartbeat counter
HEARTBEAT_S = 0.25
#: a launched worker whose counter has not moved for this long is taken for dead
STALE_S = 2.0


def error_key(rank: int) -> str:
    return f"warmcap/error/{rank}"


def beat_key(rank: int) -> str:
    return f"warmcap/beat/{rank}"


class WorkerWatch(Protocol):
    """What the executor asks about its workers (ranks 1..N-1)."""

    #: how long, after a failed collective, to look for a worker that caused it
    grace_s: float

    def reported(self) -> tuple[int, str, str] | None:
        """A worker's own error report: (rank, message, traceback), or None."""

    def dead(self) -> int | None:
        """A worker known to be gone right now (cheap: called before every step), or None."""

    def death(self, *, joined: bool) -> RankFailedError | None:
        """The failure of a worker that died, if one did (may take :attr:`grace_s` to tell);
        ``joined``: the group had formed (a death before that is a failed start)."""

    def stop(self, grace_s: float = 0.0) -> None:
        """Make sure every worker this watch can reach has ended."""


class SpawnedWorkers:
    """Workers that rank 0 spawned itself: process handles and an error queue."""

    grace_s = 1.0

    def __init__(self, procs: list[Any], errors: Any) -> None:
        self.procs = procs
        self.errors = errors

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.procs]

    def reported(self) -> tuple[int, str, str] | None:
        try:
            return self.errors.get_nowait()
        except (queue_mod.Empty, OSError, ValueError):
            return None

    def dead(self) -> int | None:
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                return rank
        return None

    def death(self, *, joined: bool) -> RankFailedError | None:
        rank = self.dead()
        if rank is None:
            return None
        # A worker that raised puts its error on the queue just before it exits.
        with contextlib.suppress(queue_mod.Empty, OSError, ValueError):
            return failure_from_report(*self.errors.get(timeout=POLL_S))
        what = describe_exit(self.procs[rank - 1])
        if not joined:
            # Died before joining and reported nothing: most often the spawned process failed to
            # import the script that started the engine.
            what += (
                " while starting; workers are spawned processes that import the main script, so a "
                'script that starts a tensor-parallel engine must do it under if __name__ == "__main__":'
            )
        return RankFailedError(rank, what)

    def stop(self, grace_s: float = 0.0) -> None:
        stop_processes(self.procs, grace_s=grace_s)


class LaunchedWorkers:
    """Workers a launcher started: watched through the group's store (see the module docstring)."""

    grace_s = STALE_S + 1.0

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        #: rank -> (last counter seen, when it last moved)
        self._beats: dict[int, tuple[int, float]] = {}

    @staticmethod
    def _store() -> dist.Store | None:
        # None until rank 0 has joined the group (the store comes with it) and after it left.
        with contextlib.suppress(RuntimeError):
            return group_store()
        return None

    def reported(self) -> tuple[int, str, str] | None:
        store = self._store()
        if store is None:
            return None
        for rank in range(1, self.world_size):
            key = error_key(rank)
            # NOTE: a store whose server is going away answers nothing; then there is no report.
            with contextlib.suppress(Exception):
                if store.check([key]):
                    message, _, trace = store.get(key).decode().partition("\n")
                    return rank, message, trace
        return None

    def dead(self) -> int | None:
        # Telling death needs two looks STALE_S apart; before every step that would cost a store
        # round trip per rank, so a death is found when a collective fails instead.
        return None

    def death(self, *, joined: bool) -> RankFailedError | None:
        store = self._store()
        if store is None:
            return None
        now = time.monotonic()
        for rank in range(1, self.world_size):
            try:
                count = store.add(beat_key(rank), 0)
            except Exception:
                return None
            seen, since = self._beats.get(rank, (-1, now))
            if count != seen:
                self._beats[rank] = (count, now)
            elif now - since >= STALE_S:
                return RankFailedError(
                    rank,
                    f"it stopped answering (no heartbeat for {now - since:.1f} s); it was started by a "
                    "launcher, so its exit status is known only where it ran",
                )
        return None

    def stop(self, grace_s: float = 0.0) -> None:
        # Launched workers leave on Stop or when rank 0's group goes away; nothing to kill from here.
        return None


class Heartbeat:
    """A launched worker's heartbeat: a daemon thread bumping ``warmcap/beat/<rank>`` in the store."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self._store = store
        self._key = beat_key(rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"warmcap-heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(HEARTBEAT_S * 4)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._store.add(self._key, 1)
            except Exception:
                return  # rank 0's store is gone: the group is over


def failure_from_report(rank: int, message: str, trace: str) -> RankFailedError:
    """A worker's own error report: its message in the exception, its traceback in the log."""
    logger.error("tensor-parallel rank %d failed:\n%s", rank, trace)
    return RankFailedError(rank, message)


def report_to_store(store: dist.Store, rank: int, message: str, trace: str) -> None:
    """Leave a launched worker's error for rank 0 (best effort: rank 0 may be gone already)."""
    with contextlib.suppress(Exception):
        store.set(error_key(rank), f"{message}\n{trace}")
