"""How rank 0 drives the worker ranks: Python objects broadcast over a gloo process group, or,
for ranks on one machine, through a shared-memory ring.

Every command (the engine's config at start, a step's ``SchedulerOutput``, a start-up hook, stop) and every per-step agreement
(the sampled tokens) travels with ``torch.distributed.broadcast_object_list`` from rank 0, and
per-rank results come back with ``gather_object``. They ride a second process group made for them:
always ``gloo`` (the objects are pickled into CPU tensors, also when the model's group is NCCL) and
with a long timeout, because a worker waits on it for the next command for as long as the engine
is idle. A peer that dies closes its sockets, so a pending broadcast fails at once whatever the
timeout; the model's own group keeps the short collective timeout for hung peers.

When the ranks share one machine (``rendezvous.local_group``), :meth:`CommandChannel.share` — the
per-step traffic: the step's ``SchedulerOutput`` and the sampled tokens — goes through the
shared-memory ring instead (``distributed/shm_ring.py``): rank 0 pickles once into a slot, the
workers poll for it; no sockets, no size exchange. A message larger than a slot (a warmup plan sent
with a hook) still takes the broadcast. ``gather`` and ``min_int`` (start-up only) stay on gloo.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from warmcap.distributed.rendezvous import local_group
from warmcap.distributed.shm_ring import ShmRing


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
    #: the shared-memory ring when the ranks share one machine (``share`` then goes through it)
    ring: ShmRing | None = None

    @classmethod
    def open(cls, rank: int, world_size: int) -> CommandChannel:
        """Create the command group; every rank of the default group must call this, in the same order."""
        local = local_group()
        group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        return cls(rank, world_size, group, ring=None if local is None else local.ring)

    @property
    def transport(self) -> str:
        """What ``share`` rides: ``shm`` (the ring) or ``gloo`` (the broadcast)."""
        return "gloo" if self.ring is None else "shm"

    @property
    def is_driver(self) -> bool:
        """Rank 0: the engine's process, which owns the scheduler and sends the commands."""
        return self.rank == 0

    def share(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (the others' argument is ignored)."""
        if self.ring is not None:
            if self.is_driver:
                payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
                if len(payload) <= self.ring.max_bytes:
                    self.ring.send(payload)
                    return obj
                self.ring.send(None)
            else:
                payload = self.ring.recv()
                if payload is not None:
                    return pickle.loads(payload)
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
