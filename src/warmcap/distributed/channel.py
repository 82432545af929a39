"""How rank 0 drives the worker ranks: Python objects broadcast over a gloo process group.

Every command (the engine's config at start, a step's ``SchedulerOutput``, a start-up hook, stop) and every per-step agreement
(the sampled tokens) travels with ``torch.distributed.broadcast_object_list`` from rank 0, and
per-rank results come back with ``gather_object``. They ride a second process group made for them:
always ``gloo`` (the objects are pickled into CPU tensors, also when the model's group is NCCL) and
with a long timeout, because a worker waits on it for the next command for as long as the engine
is idle. A peer that dies closes its sockets, so a pending broadcast fails at once whatever the
timeout; the model's own group keeps the short collective timeout for hung peers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Launch:
    """The first command: rank 0's finished engine config, where it loaded the model from and its
    device; a worker builds its rank from these (``distributed/worker.py:build_rank``)."""

    config: Any
    model_path: Any
    device: Any


@dataclass(frozen=True, slots=True)
class Step:
    """Run one scheduled step (``ModelRunner.execute_model``)."""

    scheduler_output: Any


@dataclass(frozen=True, slots=True)
class RunHook:
    """Run a start-up hook on the rank's own start-up context, then send its summary to rank 0."""

    hook: Any


@dataclass(frozen=True, slots=True)
class Stop:
    """Leave the command loop and the group; the worker process then exits."""


#: how long a worker may wait for rank 0's next command (an idle engine sends none)
IDLE_TIMEOUT = timedelta(days=30)


@dataclass(slots=True)
class CommandChannel:
    """One rank's end of the command group; rank 0 sends, the others receive.

    ``lockstep``: every rank is running the same code right now (a start-up hook), so rank 0's
    runner must not announce its steps as commands; the workers reach them on their own.
    """

    rank: int
    world_size: int
    group: Any
    lockstep: bool = field(default=False)

    @classmethod
    def open(cls, rank: int, world_size: int) -> CommandChannel:
        """Create the command group; every rank of the default group must call this, in the same order."""
        return cls(rank, world_size, dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))

    @property
    def is_driver(self) -> bool:
        """Rank 0: the engine's process, which owns the scheduler and sends the commands."""
        return self.rank == 0

    def share(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (the others' argument is ignored)."""
        box = [obj if self.is_driver else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank 0; None on the other ranks."""
        out: list[Any] | None = [None] * self.world_size if self.is_driver else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks, on every rank."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    @contextmanager
    def in_lockstep(self) -> Iterator[None]:
        """Rank 0 runs code the workers run too (see the class docstring)."""
        before = self.lockstep
        self.lockstep = True
        try:
            yield
        finally:
            self.lockstep = before
