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

from warmcap.config import KernelConfig
from warmcap.models.llama import LlamaAttention
from warmcap.models.loader import load_model
from warmcap.models.packed_linear import PackedLinear, unpack_linears


def greedy_logits(
    model_dir: str,
    prompts: list[list[int]],
    steps: int,
    *,
    packed: bool = False,
    kernels: KernelConfig | None = None,
) -> dict[str, object]:
    """Prefill ``prompts`` in one batch, then ``steps`` batched greedy decode steps over the paged
    KV cache; the tokens, every step's last-position logits and this process's KV head count.
    ``packed``: keep the linears as the loader packed them (the engine's kernels; ``packed_classes``
    says which classes were packed) instead of plain GEMMs. ``kernels``: the loader's kernel
    switches (None: their defaults); ``offload_on`` says which attention layers run the K/V
    offload (``models/llama.py`` KVOffload)."""
    model = load_model(model_dir, kernels=kernels)
    offload_on = [m.kv_offload_on for m in model.modules() if isinstance(m, LlamaAttention)]
    packed_classes = sorted({m.unpacked_class.__name__ for m in model.modules() if type(m) is PackedLinear})
    if not packed:
        # Plain GEMMs on both sides: this compares the sharding alone, not a packed kernel's
        # summation order against MKL's.
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
        "packed_classes": packed_classes if packed else [],
        "offload_on": offload_on,
        "params": {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)},
    }


def greedy_on_rank(
    rank: int, model_dir: str, prompts: list[list[int]], steps: int, packed: bool = False
) -> dict[str, object]:
    return greedy_logits(model_dir, prompts, steps, packed=packed)


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


def shm_vs_gloo(rank: int) -> dict[str, object]:
    """Each rank's all-reduce and all-gather results through the group's shared memory and through
    gloo (``torch.distributed`` on the same group), for dtypes, shapes, a transposed (strided)
    input and a tensor larger than one shared buffer (it goes through in chunks). Float32 contiguous
    all-reduces take the C call, the others Python's, interleaved on the same sequence numbers."""
    import torch.distributed as dist

    from warmcap.contracts.parallel import all_gather_last_dim, all_reduce_sum, parallel_state
    from warmcap.distributed.shm_segment import DATA_BYTES

    comm = parallel_state().comm
    g = torch.Generator().manual_seed(1234 + rank)
    cases = {
        "decode f32": torch.randn(8, 576, generator=g),
        "bf16": torch.randn(5, 64, generator=g).to(torch.bfloat16),
        "strided": torch.randn(64, 6, generator=g).t(),
        "chunked": torch.randn(DATA_BYTES // 4 * 2 + 77, generator=g),
        "empty": torch.randn(0, 576, generator=g),
    }
    reduce, gather = {}, {}
    for name, x in cases.items():
        shm = all_reduce_sum(x.clone())
        ref = x.clone()
        dist.all_reduce(ref)
        reduce[name] = (shm, ref)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        gather[name] = (all_gather_last_dim(x), torch.cat(parts, dim=-1))
    return {
        "transport": getattr(comm, "name", "gloo"),
        "compiled": getattr(comm, "replayable", False),
        "reduce": reduce,
        "gather": gather,
    }


def shm_commands(rank: int) -> dict[str, object]:
    """Rank 0 shares a run of commands (more than the ring holds, some larger than a slot); every
    rank returns what it got, in order."""
    from warmcap.distributed.channel import CommandChannel

    channel = CommandChannel.open(rank, 2)
    messages: list[object] = [{"step": i, "ids": list(range(i * 10))} for i in range(12)]
    messages[3] = bytes(range(256)) * 1300  # larger than a ring slot
    messages[10] = b"\x01" * 400_000
    received = [channel.share(m if rank == 0 else None) for m in messages]
    return {"transport": channel.transport, "received": received}


def sharded_head_argmax(rank: int, model_dir: str, rows: torch.Tensor) -> dict[str, object]:
    """The rank's screened greedy head over the vocabulary-parallel LM head (``ShardedGreedyHead``)
    on ``rows`` (hidden rows), beside ``row_argmax`` of the gathered full logits; then the same rows
    with rank 1 declining, and with rank 1 holding no screen at all."""
    from warmcap.models.greedy_head import ShardedGreedyHead
    from warmcap.runner_v2.sampler import row_argmax

    model = load_model(model_dir)
    head = model.greedy_head()
    assert isinstance(head, ShardedGreedyHead), type(head)
    screened = head.argmax(rows)
    full = row_argmax(model.compute_logits(rows))
    declined = head.argmax(rows, decline=rank == 1)
    # a rank without a screen (another machine's CPU, say): every rank falls back, for good
    if rank == 1:
        head.local = None
    without = [head.argmax(rows) for _ in range(2)]
    return {
        "screens": head.local is not None or rank == 1,
        "vocab_start": head.vocab_start,
        "screened": screened,
        "full": full,
        "declined": declined,
        "without": without,
        "off": head.off,
    }


def kv_offload_greedy(
    rank: int, model_dir: str, prompts: list[list[int]], steps: int, mode: str, mail_tokens: int | None
) -> dict[str, object]:
    """:func:`greedy_logits` on the packed kernels with ``kernel.tp_balance`` = ``mode``, and what
    the K/V offload did: the messages rank 1 posted and rank 0 took. ``mail_tokens``: shrink the
    mailbox to that many tokens' K/V first (the tiny model's: 2 KV heads x head_dim 16, k and v), so
    a pass of more tokens projects its K/V on the giver as without the offload."""
    from warmcap.config import KernelConfig
    from warmcap.contracts.parallel import parallel_state
    from warmcap.distributed.shm_segment import MAIL, TAKEN

    comm = parallel_state().comm
    if mail_tokens is not None:
        comm._mail = [m[: mail_tokens * 64] for m in comm._mail]  # type: ignore[attr-defined]
    out = greedy_logits(model_dir, prompts, steps, packed=True, kernels=KernelConfig(tp_balance=mode))
    out.pop("params")
    seg = comm.seg  # type: ignore[attr-defined]
    out["posted"], out["taken"] = seg.get(1, MAIL), seg.get(0, TAKEN)
    return out


def mailbox_messages(rank: int, messages: int) -> dict[str, object]:
    """Rank 1 posts ``messages`` tensors (message i: a [3, 5] run of i * 100 + 0..14), each after an
    all-reduce (as the K/V offload's protocol has it), then leaves the group; rank 0 fetches each
    and then one more, which must end with the peer gone rather than hang."""
    from warmcap.contracts.parallel import all_reduce_sum, fetch_from_peer, parallel_state, post_to_peer
    from warmcap.distributed.shm_segment import PeerGoneError

    comm = parallel_state().comm
    got: list[torch.Tensor] = []
    for i in range(messages):
        all_reduce_sum(torch.ones(4))
        if rank == 1:
            post_to_peer(torch.arange(15, dtype=torch.float32).view(3, 5) + 100 * i)
        else:
            got.append(fetch_from_peer(1, (3, 5)).clone())
    all_reduce_sum(torch.ones(4))
    if rank == 1:
        comm.seg.close()  # type: ignore[attr-defined]
        return {}
    start = time.monotonic()
    try:
        fetch_from_peer(1, (3, 5))
        error = ""
    except PeerGoneError as e:
        error = str(e)
    return {"got": got, "error": error, "seconds": time.monotonic() - start}
