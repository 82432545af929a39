"""Rank 0's side of a tensor-parallel engine: start the worker ranks, drive them, watch them.

``LLMEngine`` (``engine.py``) builds a :class:`TPExecutor` when ``tensor_parallel_size > 1``,
before it loads its own shard. The executor spawns ranks 1..N-1 (:mod:`warmcap.distributed.worker`)
— or finds them started by a launcher (``RANK`` set, :mod:`warmcap.distributed.launch`) —, joins
the group as rank 0 in the engine's own process, opens the command channel and sends every worker
the engine's config (:class:`~warmcap.distributed.channel.Launch`). From then on:

- the engine's runner is a :class:`~warmcap.distributed.tp_runner.TPModelRunner` built by
  :meth:`TPExecutor.make_runner`, which announces each step to the workers;
- the pool size is the smallest over the ranks (:meth:`TPExecutor.agree_num_blocks`);
- start-up hooks run on every rank in lockstep (:meth:`TPExecutor.run_hook`): the warmup plan is
  made once, here, and sent with the hook; each rank audits its own KV writes, scrubs its own
  tensors and verifies its own graphs; the summaries come back as per-rank report rows.

Failures: workers are watched (:mod:`warmcap.distributed.workers`: process handles for spawned
workers, heartbeats and error reports in the group's store for launched ones). Any error while the
ranks work together becomes a :class:`~warmcap.distributed.spawn.RankFailedError` naming the rank
that died or raised (a worker's own error message included), every worker is stopped, and the
engine refuses further steps. :meth:`TPExecutor.shutdown` (also run at interpreter exit) stops the
workers and leaves the group.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import pickle
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp

from warmcap.config import EngineConfig
from warmcap.distributed.channel import CommandChannel, Launch, RunHook, Stop
from warmcap.distributed.rank_report import rank_rows, summarize
from warmcap.distributed.rendezvous import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    Rendezvous,
    join_group,
    launched_rank,
    launched_rendezvous,
    leave_group,
    rendezvous_for,
)
from warmcap.distributed.spawn import POLL_S, RankFailedError
from warmcap.distributed.tp_runner import TPModelRunner
from warmcap.distributed.worker import worker_main
from warmcap.distributed.workers import LaunchedWorkers, SpawnedWorkers, WorkerWatch, failure_from_report
from warmcap.errors import ConfigError, WarmcapError
from warmcap.kernels.cpu.threads import prefer_yielding_wait

if TYPE_CHECKING:
    from warmcap.graphs.proof.report import RankRow
    from warmcap.startup_hooks import StartupContext, StartupHook


#: how long workers told to stop get to leave on their own before they are terminated
STOP_GRACE_S = 5.0


class TensorParallelStoppedError(WarmcapError):
    """The engine's tensor-parallel group was shut down (or failed earlier): it runs no more steps."""


class TPExecutor:
    """Rank 0 of a tensor-parallel group; see the module docstring. Build with :meth:`start`."""

    def __init__(self, world_size: int, workers: WorkerWatch) -> None:
        self.world_size = world_size
        self._workers = workers
        self._channel: CommandChannel | None = None
        self._stopped: str | None = None
        self._halted = False
        #: hook name -> each rank's summary of its result, in rank order
        self.summaries: dict[str, list[dict[str, Any]]] = {}

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        model_path: Path,
        device: torch.device,
        *,
        timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    ) -> TPExecutor:
        """Join the group as rank 0 in this process, with ranks 1..N-1 spawned here, or, when a
        launcher set ``RANK=0`` (:mod:`warmcap.distributed.launch`), started by that launcher.
        Then every worker gets this config and builds its rank.

        NOTE: the parallel state is process-global (``contracts/parallel.py``): one
        tensor-parallel engine per process at a time, and a model built in this process before
        :meth:`shutdown` is this rank's shard.
        """
        import torch.distributed as dist

        if dist.is_initialized():
            raise ConfigError(
                "this process already belongs to a torch.distributed group (another tensor-parallel "
                "engine is running): shut it down first (LLM.shutdown()), one TP engine per process"
            )
        n = config.tensor_parallel_size
        launched = launched_rank()
        if launched is None:
            executor, rendezvous = cls._spawn(n, device, timeout_s, config.kernel.tp_comm)
        else:
            if launched != 0:
                raise ConfigError(
                    f"RANK={launched} in the environment: this process is a worker of a multi-process "
                    "launch and cannot run an engine; start it with `warmup worker` (or the same warmup "
                    "command as rank 0), or call warmcap.distributed.launch.run_launched_worker()"
                )
            rendezvous = replace(launched_rendezvous(device_type=device.type), tp_comm=config.kernel.tp_comm)
            if rendezvous.world_size != n:
                raise ConfigError(
                    f"WORLD_SIZE={rendezvous.world_size} in the environment but tensor_parallel_size = {n}; "
                    "set them to the same value"
                )
            executor = cls(n, LaunchedWorkers(n))
            atexit.register(executor.shutdown)
        with executor.guarded():
            executor._join(rendezvous, timeout_s)
            executor._channel = CommandChannel.open(0, n)
            executor._channel.share(Launch(config, Path(model_path).resolve(), device))
        return executor

    @classmethod
    def _spawn(
        cls, n: int, device: torch.device, timeout_s: float, tp_comm: str
    ) -> tuple[TPExecutor, Rendezvous]:
        rendezvous = replace(rendezvous_for(n, device_type=device.type), tp_comm=tp_comm)
        # NOTE: the workers are fresh processes: their OpenMP runtime starts with this environment.
        prefer_yielding_wait()
        ctx = mp.get_context("spawn")
        errors = ctx.Queue()
        procs = [
            ctx.Process(
                target=worker_main,
                args=(rank, rendezvous, timeout_s, errors),
                name=f"warmcap-tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, n)
        ]
        executor = cls(n, SpawnedWorkers(procs, errors))
        atexit.register(executor.shutdown)
        try:
            for p in procs:
                p.start()
        except BaseException:
            executor._halt()
            raise
        return executor, rendezvous

    def _join(self, rendezvous: Rendezvous, timeout_s: float) -> None:
        """Join the group as rank 0, watching the workers meanwhile: one that dies before it joins
        fails start-up at once instead of after the rendezvous timeout."""
        failed: list[BaseException] = []

        def join() -> None:
            try:
                join_group(0, rendezvous, timeout_s=timeout_s)
            except BaseException as e:
                failed.append(e)

        # NOTE: a daemon thread: if a worker died, the rendezvous it waits in ends by its timeout.
        joiner = threading.Thread(target=join, name="warmcap-tp-join", daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(POLL_S)
            if joiner.is_alive() and self._workers.dead() is not None:
                raise self._failure(None)
        if failed:
            raise failed[0]

    # ---- what the engine calls -------------------------------------------------------------------

    @property
    def channel(self) -> CommandChannel:
        if self._channel is None:
            raise TensorParallelStoppedError("the tensor-parallel group never started")
        return self._channel

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1, in rank order, when this process spawned them."""
        if not isinstance(self._workers, SpawnedWorkers):
            raise RuntimeError("the workers were started by a launcher, not by this process")
        return self._workers.pids

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The smallest of every rank's pool size, so every rank holds the same block ids."""
        with self.guarded():
            return self.channel.min_int(num_blocks)

    def make_runner(self, *args: Any, **kwargs: Any) -> TPModelRunner:
        """Rank 0's runner: ``ModelRunner``'s arguments; it announces its steps to the workers."""
        return TPModelRunner(*args, channel=self.channel, guard=self.guarded, **kwargs)

    def run_hook(self, hook: StartupHook, ctx: StartupContext) -> Any:
        """Run start-up ``hook`` on every rank at once and keep each rank's summary; returns rank 0's
        result. A warmup hook gets the plan made here, so every rank runs the same steps."""
        from warmcap.startup_hooks import hook_name

        name = hook_name(hook)
        if name == "warmup" and "plan" in inspect.signature(hook).parameters:
            from warmcap.warmup.planner import plan_warmup

            hook = functools.partial(hook, plan=plan_warmup(ctx.config, ctx.kv_groups, ctx.num_blocks))
        try:
            pickle.dumps(hook)
        except Exception as e:
            raise ConfigError(
                f"start-up hook {name!r} cannot be sent to the worker ranks ({type(e).__name__}: {e}); "
                "under tensor parallelism a hook must be a module-level function or a functools.partial of one"
            ) from None
        with self.guarded():
            self.channel.share(RunHook(hook))
            with self.channel.in_lockstep():
                result = hook(ctx)
            gathered = self.channel.gather(summarize(name, result))
        self.summaries[name] = gathered or []
        return result

    def rank_rows(self) -> list[RankRow]:
        """One report row per rank: its warmup audit and graph verification."""
        return rank_rows(self.summaries, self.world_size)

    def shutdown(self) -> None:
        """Stop every worker (asked first, then terminated) and leave the group; idempotent."""
        if self._stopped is None:
            self._stopped = "it was shut down"
            if self._channel is not None:
                # NOTE: a worker that died makes this raise; the processes are stopped below anyway.
                with contextlib.suppress(Exception):
                    self._channel.share(Stop())
        self._halt(grace_s=STOP_GRACE_S)

    # ---- failure -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """Refuse work once the group is stopped; turn any error inside into the failure of the
        rank that caused it (see :meth:`_failure`), stopping every worker first."""
        if self._stopped is not None:
            raise TensorParallelStoppedError(
                f"the tensor-parallel group is stopped ({self._stopped}): start a new engine"
            )
        if self._workers.dead() is not None:
            raise self._failure(None)
        try:
            yield
        except BaseException as e:
            failure = self._failure(e)
            if failure is e:
                raise
            raise failure from e

    def _failure(self, error: BaseException | None) -> BaseException:
        """The error to raise for a failed group, after stopping it: the worker that reported an
        error or died (waiting briefly for one: a peer's death is the likelier cause of rank 0's
        error), else rank 0's own ``error``."""
        end = time.monotonic() + (self._workers.grace_s if error is not None else 0.0)
        culprit: RankFailedError | None = None
        while culprit is None:
            report = self._workers.reported()
            culprit = (
                failure_from_report(*report)
                if report is not None
                else self._workers.death(joined=self._channel is not None)
            )
            if culprit is not None or time.monotonic() >= end:
                break
            time.sleep(POLL_S / 4)
        self._stopped = (
            str(culprit) if culprit is not None else f"rank 0 failed: {type(error).__name__}: {error}"
        )
        self._halt()
        if culprit is not None:
            return culprit
        assert error is not None
        return error

    def _halt(self, grace_s: float = 0.0) -> None:
        # NOTE: once only: a late second call (the LLM's __del__ after shutdown()) must not leave
        # the group of another engine started in this process since.
        if self._halted:
            return
        self._halted = True
        self._workers.stop(grace_s=grace_s)
        leave_group()
        self._channel = None
        with contextlib.suppress(Exception):
            atexit.unregister(self.shutdown)
