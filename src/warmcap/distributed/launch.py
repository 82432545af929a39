"""Joining a tensor-parallel group that a launcher started: one process per rank, told its rank by
the standard torch.distributed environment (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
``RANK``; ``LOCAL_RANK`` picks the GPU on its machine). This is how ranks run on several machines.

Rank 0 is the engine: any ``warmup`` command (or ``LLM(...)``) with ``--tensor-parallel-size N``
run with ``RANK=0``; its executor then spawns nothing and waits for the others to join
(``distributed/executor.py``). Every other rank runs :func:`run_launched_worker` — ``warmup worker``,
or the very same ``warmup`` command as rank 0, which becomes a worker when it sees ``RANK`` > 0 (so
``torchrun --nproc-per-node N --no-python warmup run -tp N`` works as is). A worker needs no model or
engine flags: rank 0 sends its finished config (:class:`~warmcap.distributed.channel.Launch`), and
the worker loads the model from the same path if it exists on its machine, else resolves the same
model name there (a preset is converted locally; a directory must exist at the same path).

A launched worker reports to rank 0 through the group's store (``distributed/workers.py``): its
error if it raises, and a heartbeat, so rank 0 names the rank that failed. It exits 0 when rank 0
shuts the engine down and 1 when it fails or rank 0 goes away.
"""

from __future__ import annotations

import logging
import socket
import time
import traceback
from pathlib import Path

import torch

from warmcap import env
from warmcap.distributed.channel import CommandChannel, Launch
from warmcap.distributed.rendezvous import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    group_store,
    join_group,
    launched_rank,
    launched_rendezvous,
    leave_group,
)
from warmcap.distributed.worker import build_rank, receive_launch, serve_commands
from warmcap.distributed.workers import Heartbeat, report_to_store
from warmcap.errors import ConfigError

logger = logging.getLogger("warmcap.distributed")


def is_launched_worker() -> bool:
    """True in a process a launcher started as a rank other than 0 (``RANK`` set and > 0)."""
    rank = launched_rank()
    return rank is not None and rank > 0


def run_launched_worker(*, timeout_s: float | None = None) -> int:
    """Be this process's rank (from ``RANK``) until rank 0 stops the engine; the exit status.

    ``timeout_s`` bounds the wait for rank 0 to open the group and every collective (default:
    the group's collective timeout).
    Raises :class:`ConfigError` when the launch environment is missing or inconsistent, or names
    rank 0 (which runs the engine, not this).
    """
    rank = launched_rank()
    if rank is None or rank == 0:
        raise ConfigError(
            f"`warmup worker` runs a tensor-parallel rank > 0 started by a launcher, but RANK is "
            f"{'not set' if rank is None else '0'}; set RANK (and MASTER_ADDR, MASTER_PORT, WORLD_SIZE) "
            "as torchrun does, and run the engine's own command (e.g. `warmup serve -tp N`) as rank 0"
        )
    if timeout_s is None:
        timeout_s = DEFAULT_COLLECTIVE_TIMEOUT_S
    # The device type decides the backend; rank 0's device arrives with the launch command.
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    rendezvous = launched_rendezvous(device_type=device_type)
    logger.info(
        "rank %d of %d: joining %s:%d",
        rank,
        rendezvous.world_size,
        rendezvous.master_addr,
        rendezvous.master_port,
    )
    try:
        _wait_for_rank0(rendezvous.master_addr, rendezvous.master_port, timeout_s)
        join_group(rank, rendezvous, timeout_s=timeout_s)
    except Exception as e:
        logger.error(
            "rank %d could not join the group at %s:%d within %.0f s (%s: %s); is rank 0 running with the "
            "same MASTER_ADDR, MASTER_PORT and WORLD_SIZE?",
            rank, rendezvous.master_addr, rendezvous.master_port, timeout_s, type(e).__name__, e,
        )  # fmt: skip
        return 1
    store = group_store()
    heartbeat = Heartbeat(store, rank).start()
    try:
        channel = CommandChannel.open(rank, rendezvous.world_size)
        launch = receive_launch(channel)
        ctx = build_rank(
            rank, launch, channel, model_path=_local_model_path(launch), local_rank=_local_rank(rank)
        )
        logger.info("rank %d ready: serving rank 0's commands", rank)
        serve_commands(ctx, channel)
    except BaseException as e:
        message = f"{type(e).__name__}: {e}"
        report_to_store(store, rank, message, traceback.format_exc())
        logger.error("rank %d failed (or rank 0 went away): %s", rank, message)
        return 1
    finally:
        heartbeat.stop()
        leave_group()
    logger.info("rank %d: rank 0 stopped the engine", rank)
    return 0


def _wait_for_rank0(addr: str, port: int, timeout_s: float) -> None:
    """Wait until rank 0's store accepts connections (it starts when rank 0 joins, which may be
    after this worker): a plain connect loop, so that a late rank 0 costs no torch connection
    retries, each of which logs a C++ stack on stderr."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing accepted connections at {addr}:{port} ({e})") from None
            time.sleep(0.2)


def _local_model_path(launch: Launch) -> Path:
    """Rank 0's model path when it exists here, else the same model resolved on this machine (a
    preset is converted here; a directory rank 0 read must exist at the same path)."""
    from warmcap.models.presets import resolve_model_path

    path = Path(launch.model_path)
    return path if path.exists() else resolve_model_path(launch.config.model.model)


def _local_rank(rank: int) -> int:
    raw = env.read("LOCAL_RANK")
    if not raw:
        return rank
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"LOCAL_RANK={raw!r} is not an integer; set it to this rank's GPU index") from None
