"""A worker rank (1..N-1) of a tensor-parallel engine: its own process, model shard, KV tensors
and runner, driven by rank 0's commands (:mod:`warmcap.distributed.channel`).

A worker learns what to build from rank 0's first command (:class:`~warmcap.distributed.channel.Launch`:
the engine's finished config, model path and device). Start-up then mirrors ``LLMEngine.__init__``
(``engine.py``) step for step where the ranks must agree:
load this rank's shard -> build the (replicated) drafter -> KV groups and this rank's pool size ->
the smallest pool over the ranks -> KV cache manager and runner. Then the worker waits for commands
until :class:`~warmcap.distributed.channel.Stop`. Any error is reported to rank 0 through
``errors`` (rank, message, traceback) and the process exits with code 1: once one rank fails, the
ranks are out of step and only a fresh group can go on.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch

from warmcap.assembly import assemble
from warmcap.config import EngineConfig
from warmcap.contracts.parallel import replicated
from warmcap.core.kv_cache_manager import KVCacheManager
from warmcap.distributed.channel import CommandChannel, Launch, RunHook, Step, Stop
from warmcap.distributed.rank_report import summarize
from warmcap.distributed.rendezvous import Rendezvous, join_group, leave_group
from warmcap.distributed.tp_runner import TPModelRunner
from warmcap.drafters import build_drafter
from warmcap.kernels.cpu.build import use_isa
from warmcap.kernels.cpu.threads import start_threads
from warmcap.kv_sizing import free_memory_bytes
from warmcap.models.dtypes import TORCH_DTYPES
from warmcap.startup_hooks import StartupContext, hook_name


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """A rank's device: ``cuda:<local_rank>`` on CUDA (one GPU per rank on each machine), else
    ``device`` itself."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def worker_main(rank: int, rendezvous: Rendezvous, timeout_s: float, errors: Any) -> None:
    """A spawned worker process: join the group, build this rank, serve commands until told to stop."""
    try:
        join_group(rank, rendezvous, timeout_s=timeout_s)
        channel = CommandChannel.open(rank, rendezvous.world_size)
        serve_commands(build_rank(rank, receive_launch(channel), channel), channel)
    except BaseException as e:
        errors.put((rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        leave_group()
        raise SystemExit(1) from None
    leave_group()


def receive_launch(channel: CommandChannel) -> Launch:
    """Rank 0's first command: what this rank is to build."""
    launch = channel.share()
    if not isinstance(launch, Launch):
        raise TypeError(f"worker expected rank 0's launch command first, got {launch!r}")
    return launch


def build_rank(
    rank: int,
    launch: Launch,
    channel: CommandChannel,
    *,
    model_path: Path | None = None,
    local_rank: int | None = None,
) -> StartupContext:
    """This rank's shard, drafter, KV groups, pool (the ranks' smallest), manager and runner, as the
    start-up context its hooks run on. ``launch`` carries rank 0's finished config; ``model_path``
    overrides its model path (a launched worker on another machine finds the model there) and
    ``local_rank`` picks this rank's GPU on its machine (default: ``rank``)."""
    from warmcap.models.loader import load_hf_config, load_model
    from warmcap.runner_v2.attention.selector import select_backend

    config: EngineConfig = launch.config
    model_path = model_path or launch.model_path
    device = rank_device(launch.device, rank if local_rank is None else local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # This rank's share of the cores, before its first parallel region; a worker is a process of its
    # own, so its team stays pinned (no caller's thread to leave unpinned between steps).
    threads = start_threads(
        device.type,
        config.cpu_threads,
        config.cpu_threads_bind,
        rank=rank,
        world_size=config.tensor_parallel_size,
    )
    if threads is not None:
        threads.pin_team()
    hf_config = load_hf_config(model_path)
    free_bytes = free_memory_bytes(device)
    torch.manual_seed(config.model.seed)
    if device.type == "cpu":
        use_isa(config.kernel.cpu_isa)
    model = load_model(
        model_path,
        dtype=TORCH_DTYPES[config.model.dtype],
        device=device,
        batch_invariant=config.model.batch_invariant,
        kernels=config.kernel,
    )
    with replicated():
        drafter = build_drafter(config, model)
    assembly = assemble(config, hf_config, model, drafter, device=device, free_bytes=free_bytes)
    num_blocks = channel.min_int(assembly.num_blocks)
    config = assembly.config
    manager = KVCacheManager(
        assembly.kv_groups,
        num_blocks,
        max_model_len=config.max_model_len,
        enable_caching=config.cache.enable_prefix_caching,
    )
    runner = TPModelRunner(
        config,
        model,
        assembly.kv_groups,
        num_blocks,
        device=device,
        attn_backend=select_backend(
            device,
            name=config.model.attention_backend,
            batch_invariant=config.model.batch_invariant,
            cpu_attention=config.kernel.cpu_attention,
        ),
        drafter=drafter,
        channel=channel,
    )
    return StartupContext(
        config=config,
        device=device,
        kv_groups=assembly.kv_groups,
        num_blocks=num_blocks,
        kv_cache_manager=manager,
        runner=runner,
    )


def serve_commands(ctx: StartupContext, channel: CommandChannel) -> None:
    """Run rank 0's commands on this rank until :class:`Stop`."""
    while True:
        command = channel.share()
        if isinstance(command, Stop):
            return
        if isinstance(command, Step):
            ctx.runner.execute_model(command.scheduler_output)
        elif isinstance(command, RunHook):
            result = command.hook(ctx)
            channel.gather(summarize(hook_name(command.hook), result))
        else:
            raise TypeError(f"worker got an unknown command {command!r} from rank 0")
