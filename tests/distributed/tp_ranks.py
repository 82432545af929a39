"""Functions each tensor-parallel rank runs in the tests (module level, so spawned ranks import
them by name) and the single-process reference they are compared with."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

# Spawned ranks and launched processes import this file outside pytest: they need the paged test
# harness (tests/models) and what it imports from the tests' root (tests/paged_metadata.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from paged_harness import PagedHarness

from warmcap.models.loader import load_model
from warmcap.models.packed_linear import unpack_linears


def greedy_logits(model_dir: str, prompts: list[list[int]], steps: int) -> dict[str, object]:
    """Prefill ``prompts`` in one batch, then ``steps`` batched greedy decode steps over the paged
    KV cache; the tokens, every step's last-position logits and this process's KV head count."""
    model = load_model(model_dir)
    # Plain GEMMs as the shards run them: this compares the sharding, not oneDNN's packed kernel
    # (which the loader gives an unsharded CPU model) against MKL's rounding.
    unpack_linears(model)
    specs = model.kv_layer_specs(16)
    harness = PagedHarness(model, specs)
    ids = [f"r{i}" for i in range(len(prompts))]
    batch = [(r, list(p), 0) for r, p in zip(ids, prompts, strict=True)]
    tokens: list[list[int]] = [[] for _ in prompts]
    history: list[torch.Tensor] = []
    for _ in range(steps):
        logits = harness.step(batch)
        ends = torch.tensor([len(b[1]) for b in batch]).cumsum(0) - 1
        last = logits[ends]
        history.append(last)
        for out, t in zip(tokens, last.argmax(-1).tolist(), strict=True):
            out.append(int(t))
        batch = [(r, [out[-1]], 0) for r, out in zip(ids, tokens, strict=True)]
    return {
        "tokens": tokens,
        "logits": torch.stack(history),
        "kv_heads": sorted({s.num_kv_heads for s in specs.values()}),
        "params": {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)},
    }


def greedy_on_rank(rank: int, model_dir: str, prompts: list[list[int]], steps: int) -> dict[str, object]:
    return greedy_logits(model_dir, prompts, steps)


def raise_on_rank(rank: int, bad_rank: int) -> int:
    if rank == bad_rank:
        raise RuntimeError("deliberate failure in the test")
    return rank


def die_mid_collective(rank: int, dying_rank: int, how: str) -> int:
    """Every rank all-reduces in a loop; ``dying_rank`` dies after a few rounds (``how``: "exit"
    exits abruptly with code 17, "sigkill" is killed as ``kill -9`` would), leaving its peers inside
    a collective."""
    import signal

    import torch.distributed as dist

    x = torch.ones(4)
    for i in range(1000):
        if rank == dying_rank and i == 3:
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(17)
        dist.all_reduce(x)
        x.fill_(1.0)
        time.sleep(0.01)
    return rank


def save_tiny(out: Path, name: str, arch: str, **overrides: object) -> Path:
    """A tiny preset's architecture with ``overrides`` (head counts ...), random weights seeded as the
    presets are, saved as an HF checkpoint in ``out``."""
    import transformers

    from warmcap.models.tiny import SEED, tiny_config

    config = tiny_config(name, **overrides)
    config.architectures = [arch]
    torch.manual_seed(SEED)
    getattr(transformers, arch)(config).save_pretrained(str(out))
    return out


def fail_on_worker(ctx: object) -> None:
    """A start-up hook that raises on rank 1 only (rank 0 goes on into the gather)."""
    from warmcap.contracts.parallel import parallel_state

    if parallel_state().rank == 1:
        raise RuntimeError("deliberate failure on the worker")
