"""Where the ranks of a tensor-parallel group meet, and how one process joins as one rank.

The standard torch.distributed environment decides when it is set (``MASTER_ADDR``,
``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``: a multi-node launch); otherwise the group meets on
127.0.0.1 at a free port. The backend is ``gloo`` on CPU and ``nccl`` on CUDA.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from warmcap.contracts.parallel import ParallelState, set_parallel_state
from warmcap.errors import ConfigError

#: seconds a collective may wait for the other ranks before it fails (instead of hanging)
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """The address every rank connects to, and the group's size and backend."""

    master_addr: str
    master_port: int
    world_size: int
    backend: str = "gloo"

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rendezvous_for(world_size: int, *, device_type: str = "cpu") -> Rendezvous:
    """The group's meeting point: ``MASTER_ADDR``/``MASTER_PORT`` when set (their ``WORLD_SIZE``
    must agree with ``world_size``), else 127.0.0.1 at a free port."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    env_world = os.environ.get("WORLD_SIZE")
    if env_world is not None and int(env_world) != world_size:
        raise ConfigError(
            f"WORLD_SIZE={env_world} in the environment but tensor_parallel_size = {world_size}; "
            "set them to the same value (or unset WORLD_SIZE for a single-machine launch)"
        )
    addr = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if addr and port:
        return Rendezvous(addr, int(port), world_size, backend)
    return Rendezvous("127.0.0.1", free_port(), world_size, backend)


def join_group(
    rank: int, rendezvous: Rendezvous, *, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
) -> ParallelState:
    """Join the process group as ``rank`` and make it this process's parallel state.

    ``timeout_s`` bounds every collective: a rank whose peer died fails with an error after at most
    that long instead of waiting forever.
    """
    dist.init_process_group(
        rendezvous.backend,
        init_method=rendezvous.init_method,
        rank=rank,
        world_size=rendezvous.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    state = ParallelState(rank=rank, world_size=rendezvous.world_size)
    set_parallel_state(state)
    return state


def leave_group() -> None:
    """Destroy this process's group (if any) and return to the single-process state."""
    set_parallel_state(None)
    if dist.is_initialized():
        dist.destroy_process_group()
