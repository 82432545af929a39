"""The tensor-parallel facts model code reads: this process's rank, the world size, the group.

A process serves one rank. Whoever starts the rank (``warmcap.distributed``) calls
:func:`set_parallel_state` once, after ``torch.distributed.init_process_group`` and before any model
is built; a model built afterwards shards itself by these facts. Without that call the state is the
single-process one (rank 0 of 1) and every collective below is the identity, so single-device code
pays nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from warmcap.errors import ConfigError


class Communicator(Protocol):
    """The model's collectives over a transport other than ``torch.distributed`` (the ranks of one
    machine over shared memory: ``distributed/shm_comm.py``)."""

    name: str

    @property
    def replayable(self) -> bool:
        """Whether its all-reduce is a C call a recorded CPU graph can replay
        (``graphs/capture/cpu_program.py``)."""
        ...

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class ParallelState:
    """One rank's place in the tensor-parallel group.

    ``group`` is the ``torch.distributed`` process group (None: the default group, or no group at
    all when ``world_size`` is 1). ``comm``, when set, carries the model's collectives instead of
    ``torch.distributed`` (chosen once, when the rank joins: ``distributed/rendezvous.py``).
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None
    comm: Communicator | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"tensor-parallel rank {self.rank} of world size {self.world_size} is not a valid "
                "place; rank must be in [0, world_size) and world_size >= 1"
            )

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1


_SINGLE = ParallelState()
_state: ParallelState = _SINGLE


def parallel_state() -> ParallelState:
    """This process's tensor-parallel state (rank 0 of 1 unless :func:`set_parallel_state` ran)."""
    return _state


def set_parallel_state(state: ParallelState | None) -> None:
    """Set (or, with None, reset to single-process) this process's tensor-parallel state.

    NOTE: process-global on purpose: one process serves one rank, and threading the state through
    every model constructor would touch every family for a fact that never changes in a process.
    """
    global _state
    _state = _SINGLE if state is None else state


@contextmanager
def replicated() -> Iterator[None]:
    """Build whole (unsharded) modules inside: the state reads as rank 0 of 1 until the block ends.

    Tensor-parallel drafters are replicated: every rank builds the full drafter inside this block,
    so its own layers are plain modules that never communicate. It may still call sharded target
    modules it shares (the embedding, the LM head), whose collectives read the restored state.
    """
    global _state
    saved = _state
    _state = _SINGLE
    try:
        yield
    finally:
        _state = saved


def split_evenly(total: int, what: str, state: ParallelState | None = None) -> tuple[int, int]:
    """``(start, size)`` of this rank's contiguous share of ``total`` items; ConfigError naming
    ``what`` when ``total`` does not divide by the world size."""
    st = state or _state
    if total % st.world_size:
        raise ConfigError(
            f"{what} = {total} does not divide by tensor_parallel_size = {st.world_size}; "
            "choose a tensor_parallel_size that divides it"
        )
    size = total // st.world_size
    return st.rank * size, size


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; the identity on one rank."""
    st = _state
    if st.is_parallel:
        if st.comm is not None:
            return st.comm.all_reduce_sum(x)
        import torch.distributed as dist

        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=st.group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension, rank order; the identity on one rank."""
    st = _state
    if not st.is_parallel:
        return x
    if st.comm is not None:
        return st.comm.all_gather_last_dim(x)
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(st.world_size)]
    dist.all_gather(parts, x.contiguous(), group=st.group)
    return torch.cat(parts, dim=-1)


def mail_floats() -> int:
    """Floats one mailbox message between this machine's ranks may hold (``distributed/shm_comm.py``
    :meth:`~warmcap.distributed.shm_comm.ShmCommunicator.post`); 0: no mailbox (one rank, gloo,
    NCCL, or no C compiler)."""
    comm = _state.comm
    return int(getattr(comm, "mail_floats", 0)) if _state.is_parallel and comm is not None else 0


def post_to_peer(x: torch.Tensor) -> None:
    """Send ``x`` to the one peer that reads this rank's mailbox (needs :func:`mail_floats`)."""
    comm = _state.comm
    assert comm is not None
    comm.post(x)  # type: ignore[attr-defined]


def fetch_from_peer(peer: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Rank ``peer``'s next message, ``shape`` float32, read in place (see :func:`post_to_peer`)."""
    comm = _state.comm
    assert comm is not None
    return comm.fetch(peer, shape)  # type: ignore[attr-defined]
