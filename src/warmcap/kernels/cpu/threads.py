"""The model threads of a CPU engine: how many, on which cores, and how they wait.

One policy for every place a CPU engine starts (``LLMEngine``, a tensor-parallel worker):

- **How many.** By default the cores this process may use (``os.sched_getaffinity``, as it was when
  first asked in this process) split evenly across the tensor-parallel ranks on this machine, at
  least one each: the ranks together never run more model threads than there are cores (two ranks
  with torch's default of one thread per core each would put two threads on every core, and each
  parallel region would wait for a descheduled thread). ``cpu_threads`` sets the threads of each
  rank instead; more than its share of cores is refused unless binding is off.
- **Where.** ``cpu_threads_bind``: ``auto`` (default) pins model thread i of rank r to the i-th core
  of r's share, as vLLM's CPU workers pin theirs (``VLLM_CPU_OMP_THREADS_BIND``); ``none`` leaves
  them to the OS scheduler; a CPU list (``0-1``, ``0,2``; ranks separated by ``|``: ``0|1``) pins
  them to those cores. Pinning goes through a parallel region of the kernels' library
  (``threads.c``), which runs on torch's own OpenMP runtime (``build.py``), so it pins the very
  threads torch's operators and the kernels use. The pool threads stay pinned; the engine's own
  thread (OpenMP's thread 0, the one that calls the model) is pinned only while a step runs
  (:meth:`CpuThreads.pinned`), so a thread or process the caller starts from it later does not
  inherit one core.
- **How they wait.** An OpenMP thread that finishes its share of a parallel region spins before it
  sleeps (GNU libgomp: 300,000 spins by default); on cores shared with other processes that spin
  burns the time slice the thread it waits for needs. :func:`prefer_yielding_wait` sets
  ``GOMP_SPINCOUNT`` (a short spin, then sleep) unless the user set ``OMP_WAIT_POLICY`` or
  ``GOMP_SPINCOUNT``. The runtime reads them once, when it loads with torch: ``import warmcap``
  before ``torch`` applies it to this process (the ``warmup`` command does), and tensor-parallel
  workers, started afresh, always get it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache

from warmcap import env
from warmcap.errors import ConfigError

log = logging.getLogger("warmcap.cpu_threads")

BIND_AUTO = "auto"
BIND_NONE = "none"
#: spins an idle OpenMP thread makes before it sleeps (libgomp's own default is 300,000): long
#: enough to bridge the gap between the back-to-back regions of one layer, short enough to give
#: the core away when the thread it waits for is not running
SPIN_COUNT = "10000"


def prefer_yielding_wait() -> None:
    """Make OpenMP threads that wait sleep soon (``GOMP_SPINCOUNT``), unless the user chose a wait
    policy. Takes effect in this process only when torch (its OpenMP runtime) is not loaded yet,
    and in every process started from it afterwards."""
    if env.is_set("OMP_WAIT_POLICY"):
        return
    env.set_default("GOMP_SPINCOUNT", SPIN_COUNT)


@cache
def process_cpus() -> tuple[int, ...]:
    """The cores this process may use, as they were when first asked (pinning the engine's thread
    later does not shrink them). Every core the OS reports where affinity is not supported."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-2,5"`` -> ``(0, 1, 2, 5)``, in the order given; raises ValueError on a bad item."""
    cpus: list[int] = []
    for item in text.split(","):
        lo, dash, hi = item.strip().partition("-")
        first, last = int(lo), int(hi) if dash else int(lo)
        if first < 0 or last < first:
            raise ValueError(item)
        cpus.extend(range(first, last + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError("a core is listed twice")
    return tuple(cpus)


def check_bind(bind: str) -> str:
    """``bind`` when it is ``auto``, ``none`` or CPU lists separated by ``|``; else ConfigError."""
    if bind in (BIND_AUTO, BIND_NONE):
        return bind
    for part in bind.split("|"):
        try:
            parse_cpu_list(part)
        except ValueError:
            raise ConfigError(
                f"cpu_threads_bind {bind!r} is not auto, none or a CPU list such as 0-3 or 0,2 (ranks "
                "separated by |, e.g. 0|1); give one of those"
            ) from None
    return bind


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    """One rank's model threads: ``threads`` of them, pinned one to a core of ``cpus`` in order when
    ``pin`` (else free to run on any core the process may use); ``why`` says how it was chosen."""

    threads: int
    cpus: tuple[int, ...]
    pin: bool
    why: str


def plan_threads(
    requested: int | None,
    bind: str,
    *,
    rank: int = 0,
    ranks: int = 1,
    cpus: Sequence[int] | None = None,
    current: int | None = None,
) -> ThreadPlan:
    """The threads of rank ``rank`` of ``ranks`` on this machine, sharing ``cpus`` (default
    :func:`process_cpus`). ``requested``: threads per rank; None: ``current`` (torch's thread count:
    its own default of one per core, ``OMP_NUM_THREADS``, or what the caller set) with one rank, and
    at most its share of the cores with several. ``bind``: see the module docstring. Raises
    ConfigError for a request that cannot be met as asked."""
    cpus = tuple(process_cpus() if cpus is None else cpus)
    check_bind(bind)
    if requested is not None and (
        isinstance(requested, bool) or not isinstance(requested, int) or requested < 1
    ):
        raise ConfigError(
            f"cpu_threads must be an integer >= 1, got {requested!r}: or leave it unset for one per core"
        )
    if bind not in (BIND_AUTO, BIND_NONE):
        lists = [parse_cpu_list(part) for part in bind.split("|")]
        outside = sorted({c for cs in lists for c in cs} - set(cpus))
        if outside:
            raise ConfigError(
                f"cpu_threads_bind {bind!r} names core(s) {outside} this process may not use (it may use "
                f"{_cpu_text(cpus)}); name cores among those"
            )
        if len(lists) == 1 and ranks > 1:
            lists = _split(lists[0], ranks)
            if lists is None:
                raise ConfigError(
                    f"cpu_threads_bind {bind!r} has fewer cores than the {ranks} tensor-parallel ranks; "
                    "give at least one core per rank"
                )
        if len(lists) != ranks:
            raise ConfigError(
                f"cpu_threads_bind {bind!r} gives {len(lists)} CPU lists for {ranks} tensor-parallel ranks; "
                "give one list, or one per rank separated by |"
            )
        share = lists[rank]
        threads = len(share) if requested is None else requested
        if threads > len(share):
            raise ConfigError(
                f"cpu_threads={threads} but cpu_threads_bind gives rank {rank} only {len(share)} core(s) "
                f"({_cpu_text(share)}); lower cpu_threads or list more cores"
            )
        return ThreadPlan(threads, share[:threads], True, f"pinned to cores {_cpu_text(share[:threads])}")
    split = _split(cpus, ranks)
    if split is None:
        # More ranks than cores: one thread each, cores shared round robin (oversubscribed).
        share = (cpus[rank % len(cpus)],)
        why = f"{ranks} ranks on {len(cpus)} core(s): one thread per rank, cores shared"
    else:
        share = split[rank]
        why = (
            f"{len(share)} of {len(cpus)} core(s) for rank {rank} of {ranks}"
            if ranks > 1
            else f"{len(cpus)} core(s)"
        )
    threads = _default(requested, current, len(share), ranks)
    if threads > len(share):
        if bind == BIND_AUTO and requested is not None:
            raise ConfigError(
                f"cpu_threads={threads} is more than the {len(share)} core(s) of rank {rank} ({why}): "
                "lower cpu_threads, or pass cpu_threads_bind=none to run more threads than cores unpinned"
            )
        return ThreadPlan(threads, cpus, False, f"{threads} threads unpinned on {why} (oversubscribed)")
    if bind == BIND_NONE or split is None:
        return ThreadPlan(threads, share, False, f"{threads} unpinned thread(s), {why}")
    return ThreadPlan(
        threads,
        share[:threads],
        True,
        f"{threads} thread(s) pinned to cores {_cpu_text(share[:threads])}, {why}",
    )


def _default(requested: int | None, current: int | None, share: int, ranks: int) -> int:
    if requested is not None:
        return requested
    if current is None:
        return share
    # One rank runs in the caller's process: its torch setting stands (pinned only if it fits).
    return current if ranks == 1 else max(1, min(current, share))


def _split(cpus: Sequence[int], ranks: int) -> list[tuple[int, ...]] | None:
    """``cpus`` in ``ranks`` equal consecutive parts (the remainder unused); None if fewer than ranks."""
    each = len(cpus) // ranks
    if each == 0:
        return None
    return [tuple(cpus[r * each : (r + 1) * each]) for r in range(ranks)]


def _cpu_text(cpus: Sequence[int]) -> str:
    return ",".join(map(str, cpus))


def local_rank_and_size(rank: int, world_size: int) -> tuple[int, int]:
    """This process's rank among the ranks on this machine and their number: torchrun's
    ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` when set (ranks launched over several machines), else
    ``rank`` of ``world_size`` (every rank spawned here)."""
    local, size = env.read("LOCAL_RANK"), env.read("LOCAL_WORLD_SIZE")
    if local and size:
        try:
            return int(local), int(size)
        except ValueError:
            pass
    return rank, world_size


_I32P = ctypes.POINTER(ctypes.c_int32)
_I64P = ctypes.POINTER(ctypes.c_int64)


def _bind_team() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """``warmcap_bind_team`` of ``threads.c``; None (with a warning) when it cannot be built."""
    from warmcap.kernels.cpu.build import KernelBuildError, load_library

    try:
        lib = load_library("threads.c")
    except KernelBuildError as exc:
        level = logging.INFO if exc.recorded else logging.WARNING
        log.log(level, "model threads stay unpinned: the pinning helper cannot be built: %s", exc)
        return None
    fn = lib.warmcap_bind_team
    fn.restype = ctypes.c_int32
    fn.argtypes = [_I32P, ctypes.c_int32, ctypes.c_int32, _I64P]
    return fn


class CpuThreads:
    """A plan applied: torch's thread count set, and (when pinned) the pool threads pinned the first
    time each engine thread asks (:meth:`pinned`)."""

    def __init__(self, plan: ThreadPlan) -> None:
        import torch

        self.plan = plan
        torch.set_num_threads(plan.threads)
        self._pinned_for: set[int] = set()
        self._lock = threading.Lock()
        #: per thread: whether it is inside a :meth:`pinned` block (an inner one changes nothing)
        self._held = threading.local()
        #: the kernel thread ids of the team, once pinned (thread 0 first)
        self.team_tids: tuple[int, ...] = ()
        log.info("model threads: %s", plan.why)

    def pin_team(self) -> bool:
        """Pin the calling thread's OpenMP team (thread i to core i of the plan) now; False when
        unpinned (the plan says so, or the helper cannot be built)."""
        if not self.plan.pin:
            return False
        fn = _bind_team()
        if fn is None:
            return False
        import torch

        n = self.plan.threads
        # NOTE: torch may have been set to another count since (a greedy-head screen runs serial).
        torch.set_num_threads(n)
        cpus = (ctypes.c_int32 * n)(*self.plan.cpus)
        tids = (ctypes.c_int64 * n)()
        got = fn(cpus, n, 1, tids)
        if got < 0:
            log.warning(
                "model thread %d could not be pinned to core %d; threads stay unpinned",
                -got - 1,
                self.plan.cpus[-got - 1],
            )
            return False
        self.team_tids = tuple(int(t) for t in tids[:got])
        with self._lock:
            self._pinned_for.add(threading.get_ident())
        return True

    def pinned(self) -> contextlib.AbstractContextManager[None]:
        """Run the block with the calling thread pinned to the plan's first core (and its team's
        pool threads pinned, once per calling thread); the thread's own cores are restored after.

        Re-entrant: inside another ``pinned`` block of the same thread (``LLM.generate`` holds one
        around its steps, each step one of its own) nothing is set or restored, which saves a step
        its three affinity system calls."""
        if getattr(self._held, "on", False):
            return contextlib.nullcontext()
        return self._hold()

    @contextlib.contextmanager
    def _hold(self) -> Iterator[None]:
        self._held.on = True
        try:
            with self._pin():
                yield
        finally:
            self._held.on = False

    @contextlib.contextmanager
    def _pin(self) -> Iterator[None]:
        if not self.plan.pin or not hasattr(os, "sched_setaffinity"):
            yield
            return
        if threading.get_ident() not in self._pinned_for:
            before = os.sched_getaffinity(0)
            if not self.pin_team():
                self.plan = ThreadPlan(
                    self.plan.threads, self.plan.cpus, False, self.plan.why + " (unpinned)"
                )
                yield
                return
            os.sched_setaffinity(0, before)
        before = os.sched_getaffinity(0)
        try:
            os.sched_setaffinity(0, {self.plan.cpus[0]})
        except OSError:
            # The core was taken from this process since (taskset, a cgroup): run where allowed.
            yield
            return
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)


def start_threads(
    device_type: str, requested: int | None, bind: str, *, rank: int = 0, world_size: int = 1
) -> CpuThreads | None:
    """The thread policy of one rank of an engine on ``device_type``: applied on CPU (torch's thread
    count now, pinning at the first step), None elsewhere (a GPU engine keeps torch's setting)."""
    if device_type != "cpu":
        return None
    import torch

    local, size = local_rank_and_size(rank, world_size)
    return CpuThreads(plan_threads(requested, bind, rank=local, ranks=size, current=torch.get_num_threads()))
