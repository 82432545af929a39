"""Where the ranks of a tensor-parallel group meet, and how one process joins as one rank.

The standard torch.distributed environment decides when it is set (``MASTER_ADDR``,
``MASTER_PORT``, ``WORLD_SIZE``; with ``RANK`` a launcher started every rank itself, see
:mod:`warmcap.distributed.launch`); otherwise the group meets on 127.0.0.1 at a free port. The
backend is ``gloo`` on CPU and ``nccl`` on CUDA. The group's key-value store (a ``TCPStore`` served
by rank 0) is kept: workers leave their errors and heartbeats in it for rank 0 to read. On CPU,
ranks that turn out to share one machine also share memory (:func:`local_group`,
``distributed/shm_comm.py``): the model's collectives and rank 0's commands then go through it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from warmcap import env
from warmcap.contracts.parallel import ParallelState, set_parallel_state
from warmcap.errors import ConfigError

if TYPE_CHECKING:
    from warmcap.distributed.shm_comm import LocalGroup

#: seconds a collective may wait for the other ranks before it fails (instead of hanging)
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0

#: the variables a launcher sets for every rank (torchrun, a job scheduler, or by hand)
LAUNCH_ENV: tuple[str, ...] = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")

#: this process's group store while it belongs to a group (see :func:`group_store`)
_store: dist.TCPStore | None = None
#: this process's shared-memory planes while its group's ranks share one machine (see :func:`local_group`)
_local: LocalGroup | None = None


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """The address every rank connects to, and the group's size and backend."""

    master_addr: str
    master_port: int
    world_size: int
    backend: str = "gloo"
    #: collectives of the ranks of one machine (the config's ``kernel.tp_comm``; None: its default)
    tp_comm: str | None = None

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
    env_world = env.read("WORLD_SIZE")
    if env_world and int(env_world) != world_size:
        raise ConfigError(
            f"WORLD_SIZE={env_world} in the environment but tensor_parallel_size = {world_size}; "
            "set them to the same value (or unset WORLD_SIZE for a single-machine launch)"
        )
    addr = env.read("MASTER_ADDR")
    port = env.read("MASTER_PORT")
    if addr and port:
        return Rendezvous(addr, int(port), world_size, backend)
    return Rendezvous("127.0.0.1", free_port(), world_size, backend)


def launched_rank() -> int | None:
    """This process's rank when a launcher started every rank itself (``RANK`` is set), else None.

    Raises :class:`ConfigError` when ``RANK`` is set but the rest of the launch environment is
    missing or does not add up, naming the variable and its value.
    """
    if not env.is_set("RANK"):
        return None
    raw = env.read("RANK")
    missing = [name for name in LAUNCH_ENV if not env.is_set(name)]
    if missing:
        raise ConfigError(
            f"RANK={raw} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: a "
            f"multi-process launch needs all of {', '.join(LAUNCH_ENV)} (torchrun sets them); unset RANK "
            "to let rank 0 start its workers on this machine"
        )
    values = {}
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        try:
            values[name] = int(env.read(name))
        except ValueError:
            raise ConfigError(f"{name}={env.read(name)!r} is not an integer; set it to one") from None
    rank, world = values["RANK"], values["WORLD_SIZE"]
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(
            f"RANK={rank} with WORLD_SIZE={world}: a rank must be in 0..WORLD_SIZE-1; fix the launch "
            "environment"
        )
    return rank


def launched_rendezvous(*, device_type: str = "cpu") -> Rendezvous:
    """The meeting point a launcher set in the environment (see :func:`launched_rank`)."""
    launched_rank()  # checks the whole environment
    return Rendezvous(
        env.read("MASTER_ADDR"),
        int(env.read("MASTER_PORT")),
        int(env.read("WORLD_SIZE")),
        "nccl" if device_type == "cuda" else "gloo",
    )


def join_group(
    rank: int, rendezvous: Rendezvous, *, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
) -> ParallelState:
    """Join the process group as ``rank`` and make it this process's parallel state.

    ``timeout_s`` bounds every collective: a rank whose peer died fails with an error after at most
    that long instead of waiting forever. It also bounds the wait for the other ranks to arrive.
    """
    global _store
    timeout = timedelta(seconds=timeout_s)
    # NOTE: the store is made here rather than by init_process_group so this process keeps a handle
    # on it (group_store). Rank 0 serves it, so it lives as long as the engine's process — unless
    # torchrun's agent already serves one at MASTER_PORT (it says so in the environment), which
    # every rank then joins as a client.
    agent_store = env.read("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        rendezvous.master_addr,
        rendezvous.master_port,
        rendezvous.world_size,
        is_master=rank == 0 and not agent_store,
        timeout=timeout,
    )
    dist.init_process_group(
        rendezvous.backend, store=store, rank=rank, world_size=rendezvous.world_size, timeout=timeout
    )
    _store = store
    comm = None
    if rendezvous.backend == "gloo" and rendezvous.world_size > 1:
        from warmcap.distributed.shm_comm import open_local_group

        global _local
        try:
            _local = open_local_group(rank, rendezvous.world_size, timeout_s, mode=rendezvous.tp_comm)
        except BaseException:
            leave_group()
            raise
        comm = None if _local is None else _local.comm
    state = ParallelState(rank=rank, world_size=rendezvous.world_size, comm=comm)
    set_parallel_state(state)
    return state


def group_store() -> dist.TCPStore:
    """The key-value store of the group this process belongs to."""
    if _store is None:
        raise RuntimeError("this process belongs to no tensor-parallel group (join_group first)")
    return _store


def local_group() -> LocalGroup | None:
    """The shared-memory planes of this process's group when its ranks share one machine (and
    ``$WARMCAP_TP_COMM`` is not ``gloo``), else None."""
    return _local


def leave_group() -> None:
    """Destroy this process's group (if any) and return to the single-process state; its
    shared-memory end is closed first, which tells peers still waiting there that it left."""
    global _store, _local
    set_parallel_state(None)
    _store = None
    if _local is not None:
        _local.close()
        _local = None
    if dist.is_initialized():
        dist.destroy_process_group()
