"""The real batch of a graph's verification: its layout, its blocks, and the passes run over it.

:func:`layout_for` picks real rows smaller than the graph (so there is padding), :func:`scratch_tables`
lays them out on blocks taken from the KV cache manager (and gives them back without a trace),
and each subject (:mod:`warmcap.graphs.capture.subjects`) builds the :class:`Passes` of the check over them
(:mod:`warmcap.graphs.proof.verify_target`, :mod:`warmcap.graphs.proof.verify_draft`). What the passes are held
to lives in :mod:`warmcap.graphs.proof.verify`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from warmcap.core.request import Request
from warmcap.sampling_params import SamplingParams

if TYPE_CHECKING:
    from warmcap.contracts import AttentionMetadata
    from warmcap.core.kv_cache_manager import KVCacheManager
    from warmcap.graphs.capture.planning import GraphSpec
    from warmcap.runner_v2.model_runner import ModelRunner

VERIFY_REQ_PREFIX = "graph-verify-"
#: the settings of every scratch request (never sampled from: one shared, validated once)
_SCRATCH_PARAMS = SamplingParams()


@dataclass(frozen=True, slots=True)
class Layout:
    query_lens: list[int]
    contexts: list[int]
    decode: bool


def layout_for(spec: GraphSpec, max_model_len: int, *, from_zero: bool = False) -> Layout | None:
    """Real rows for ``spec``: one request fewer than a uniform graph holds; one token fewer than a
    mixed graph holds, spread over up to its request cap with a prompt chunk first. ``from_zero``:
    odd rows have no context."""
    d = spec.descriptor
    if d.uniform_query_len is not None:
        q = d.uniform_query_len
        lens = [q] * max(1, d.request_cap - 1)
        decode = True
    else:
        t = max(1, d.num_tokens - 1)
        r = min(d.request_cap, t)
        lens = [t // r + (1 if i < t % r else 0) for i in range(r)]
        decode = False
    if max(lens) >= max_model_len:
        return None
    # Contexts of varied length so rows cross block boundaries at different columns.
    contexts = [
        0 if from_zero and i % 2 else min(2 + (5 * i) % 13, max_model_len - n) for i, n in enumerate(lens)
    ]
    return Layout(lens, contexts, decode)


class PoolTooSmallError(Exception):
    """The KV pool cannot hold a verification batch (reported as an unverified graph)."""


@contextmanager
def scratch_tables(
    runner: ModelRunner, manager: KVCacheManager, label: str, num_tokens: list[int]
) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
    """Blocks for throw-away requests (empty prompts: nothing enters the prefix cache) holding
    ``num_tokens[i]`` tokens each; yields host block tables per group ``[R, width]`` and the widest
    row. On exit the requests are freed tail first (restoring the free-queue order) and their blocks
    zeroed in every layer."""
    requests = [
        Request(f"{VERIFY_REQ_PREFIX}{label}-{i}", [], sampling_params=_SCRATCH_PARAMS)
        for i in range(len(num_tokens))
    ]
    taken: list[Request] = []
    try:
        for req, n in zip(requests, num_tokens, strict=True):
            if manager.allocate_slots(req, n) is None:
                raise PoolTooSmallError(label)
            taken.append(req)
        block_ids = [manager.get_block_ids(req.request_id) for req in requests]
        width = runner.max_blocks_per_req
        tables = {}
        for group in runner.batch.block_tables.group_names:
            table = torch.zeros(len(requests), width, dtype=torch.int32)
            for i, ids in enumerate(block_ids):
                table[i, : len(ids[group])] = torch.tensor(ids[group], dtype=torch.int32)
            tables[group] = table
        yield tables, max(len(ids) for b in block_ids for ids in b.values())
    finally:
        used = sorted(
            {b for req in taken for ids in manager.get_block_ids(req.request_id).values() for b in ids if b}
        )
        for req in reversed(taken):
            manager.free(req)
        runner.kv_caches.zero_blocks(used)


@dataclass(frozen=True, slots=True)
class Passes:
    """The three passes of one graph's check over a real batch, contexts written and the unpadded
    pass loaded: ``metas`` is its metadata (Mamba columns included), each pass returns its outputs
    (main output first; ``reference``: real rows only), ``greedy`` the tokens a main output picks
    (None: the pass picks none); ``logits``, where the tokens are the argmax of logits computed
    from the main output (the target), those logits: the check then tells a near tie that rounding
    tipped from a real difference (``verify.tokens_agree``)."""

    num_reqs: int
    metas: dict[str, AttentionMetadata]
    reference: Callable[[], list[torch.Tensor]]
    replay: Callable[[], list[torch.Tensor]]
    padded_eager: Callable[[], list[torch.Tensor]]
    greedy: Callable[[torch.Tensor], torch.Tensor | None]
    logits: Callable[[torch.Tensor], torch.Tensor] | None = None


def context_chunks(contexts: list[int], max_tokens: int) -> list[list[int]]:
    """Rows with a context, grouped so each group's contexts fit one pass of ``max_tokens``."""
    chunks: list[list[int]] = []
    total = max_tokens
    for i, c in enumerate(contexts):
        if c == 0:
            continue
        if total + c > max_tokens:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += c
    return chunks


def row_chunks(sizes: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive rows grouped so each group's ``sizes`` fit one pass of ``max_tokens`` (every
    size must fit on its own)."""
    chunks: list[list[int]] = []
    total = max_tokens
    for i, n in enumerate(sizes):
        if total + n > max_tokens:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += n
    return chunks
