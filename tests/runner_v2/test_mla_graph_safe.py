"""The MLA backend, the lightning indexer and the sparse MLA layer are graph-safe: they run under
FakeTensorMode with every tensor (weights, activations, metadata, host copies, caches) fake, where a
host read of device data or a data-dependent shape raises; and they never read the metadata's host
copies, which a captured graph would bake in."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import pytest
import torch
from test_mla import BS, HEADS, NOPE, NUM_BLOCKS, RANK, ROPE, VDIM, draw_blocks, make_meta
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from warmcap.contracts import AttentionMetadata, MLAWeights
from warmcap.models.mla import MLAAttention
from warmcap.models.rope import RotaryEmbedding
from warmcap.runner_v2.attention.context import StepContext
from warmcap.runner_v2.attention.mla import TorchMLABackend
from warmcap.runner_v2.attention.selector import backend_registry
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention

HOST_SYNC_ERRORS = (DataDependentOutputException, DynamicOutputShapeException)
INDEX_DIM = 16


def uniform_decode_meta() -> AttentionMetadata:
    """Three decode rows (one query each) and a padded row of one PAD token, as a decode graph sees."""
    seqs = [9, 5, 13]
    return make_meta(seqs, [1, 1, 1], draw_blocks(seqs, seed=7), pad_tokens=1)


def mixed_meta() -> AttentionMetadata:
    """A prefill chunk, a decode and a padded row of two PAD tokens."""
    return make_meta([11, 6], [4, 1], draw_blocks([11, 6], seed=8), pad_tokens=2)


METAS: dict[str, Callable[[], AttentionMetadata]] = {
    "uniform_decode": uniform_decode_meta,
    "mixed": mixed_meta,
}


def fake_meta(mode: FakeTensorMode, meta: AttentionMetadata) -> AttentionMetadata:
    return replace(
        meta,
        **{
            f.name: mode.from_tensor(v)
            for f in fields(meta)
            if isinstance(v := getattr(meta, f.name), torch.Tensor)
        },
    )


def fake_context(mode: FakeTensorMode, ctx: StepContext) -> StepContext:
    metas = {g: fake_meta(mode, m) for g, m in ctx.attn_metadata.items()}
    caches = {n: mode.from_tensor(c) for n, c in ctx.kv_caches.items()}
    return replace(ctx, attn_metadata=metas, kv_caches=caches)


def run_fake_module(module: torch.nn.Module, *inputs: Any) -> Any:
    """``module(*inputs)`` with its weights, tensor inputs and the context's tensors all fake."""
    mode = FakeTensorMode()
    state = {
        n: mode.from_tensor(t) for n, t in itertools.chain(module.named_parameters(), module.named_buffers())
    }
    args = tuple(
        mode.from_tensor(a) if isinstance(a, torch.Tensor) else fake_context(mode, a) for a in inputs
    )
    with mode, torch.no_grad():
        return torch.func.functional_call(module, state, args)


def mla_inputs(meta: AttentionMetadata, seed: int) -> tuple[list[torch.Tensor], MLAWeights]:
    gen = torch.Generator().manual_seed(seed)
    t = meta.num_tokens
    tensors = [
        torch.randn(t, HEADS, NOPE, generator=gen),
        torch.randn(t, HEADS, ROPE, generator=gen),
        torch.randn(t, RANK + ROPE, generator=gen),
        torch.randn(NUM_BLOCKS + 1, BS, RANK + ROPE, generator=gen),  # a cache already holding context
    ]
    weights = MLAWeights(
        torch.randn(HEADS, NOPE, RANK, generator=gen), torch.randn(HEADS, VDIM, RANK, generator=gen)
    )
    return tensors, weights


def with_stale_host_copies(meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata with wrong host copies, as a graph replayed after the copies changed would see."""
    return replace(
        meta,
        query_start_loc_cpu=torch.zeros_like(meta.query_start_loc),
        seq_lens_cpu=torch.full_like(meta.seq_lens, 10**6),
    )


def sparse_config() -> Any:
    from transformers import DeepseekV32Config

    return DeepseekV32Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=24, kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=VDIM,
        index_topk=3, index_n_heads=4, index_head_dim=INDEX_DIM, n_routed_experts=4, n_group=1, topk_group=1,
        max_position_embeddings=256,
    )  # fmt: skip


def positions_of(meta: AttentionMetadata) -> torch.Tensor:
    """Each token's position (0 for padded tokens), from the host-built metadata of these tests."""
    qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    pos = [lens[r] - (qsl[r + 1] - t) for r in range(meta.num_reqs) for t in range(qsl[r], qsl[r + 1])]
    return torch.tensor(pos).clamp(min=0)


def sparse_layer_inputs(
    meta_kind: str,
) -> tuple[MLAAttention, torch.Tensor, torch.Tensor, torch.Tensor, StepContext]:
    """The V3.2 attention layer (MLA + indexer) and one step's inputs over warm caches."""
    torch.manual_seed(9)
    config = sparse_config()
    attn = MLAAttention(config, 0)
    meta = METAS[meta_kind]()
    cos, sin = RotaryEmbedding.from_config(config, ROPE).cos_sin(positions_of(meta), torch.float32)
    caches = {
        attn.layer_name: torch.randn(NUM_BLOCKS + 1, BS, RANK + ROPE),
        attn.indexer.layer_name: torch.randn(NUM_BLOCKS + 1, BS, INDEX_DIM),
    }
    groups = {attn.layer_name: "mla", attn.indexer.layer_name: "indexer"}
    backends = backend_registry(TorchPagedAttention())
    ctx = StepContext(
        {"mla": meta, "indexer": meta}, groups, caches, backends, {"mla": "mla", "indexer": "indexer"}
    )
    return attn, torch.randn(meta.num_tokens, 32), cos, sin, ctx


@pytest.mark.parametrize("meta_kind", METAS)
@pytest.mark.parametrize("absorbed_max_query_len", [0, 1, 10**6])
def test_mla_backend_forward_is_graph_safe(meta_kind: str, absorbed_max_query_len: int) -> None:
    meta = METAS[meta_kind]()
    tensors, weights = mla_inputs(meta, seed=0)
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in tensors]
    fake_weights = MLAWeights(mode.from_tensor(weights.w_uk), mode.from_tensor(weights.w_uv))
    with mode:
        out = TorchMLABackend(absorbed_max_query_len).forward(
            *fakes, fake_meta(mode, meta), fake_weights, scale=0.3
        )
    assert out.shape == (meta.num_tokens, HEADS, VDIM)


@pytest.mark.parametrize("meta_kind", METAS)
def test_mla_backend_ignores_host_copies(meta_kind: str) -> None:
    meta = METAS[meta_kind]()
    tensors, weights = mla_inputs(meta, seed=1)
    outs = []
    for m in (meta, with_stale_host_copies(meta)):
        q_nope, q_pe, latent, cache = (t.clone() for t in tensors)
        outs.append(TorchMLABackend().forward(q_nope, q_pe, latent, cache, m, weights, scale=0.3))
    assert torch.equal(outs[0], outs[1])
    assert torch.count_nonzero(outs[0][-1]) == 0, "the padded token must give zeros"


@pytest.mark.parametrize("meta_kind", METAS)
def test_indexer_forward_is_graph_safe(meta_kind: str) -> None:
    attn, x, cos, sin, ctx = sparse_layer_inputs(meta_kind)
    q_resid = torch.randn(x.shape[0], 24)
    meta = ctx.attn_metadata["indexer"]
    chosen = run_fake_module(attn.indexer, x, q_resid, cos, sin, ctx)
    assert chosen.shape == (meta.num_tokens, meta.max_seq_len) and chosen.dtype == torch.bool
    with torch.no_grad():
        real = attn.indexer(x, q_resid, cos, sin, ctx)
    assert real.sum(-1).max() <= attn.indexer.top_k, "the indexer keeps at most top_k positions"


@pytest.mark.parametrize("meta_kind", METAS)
def test_sparse_mla_layer_is_graph_safe_and_ignores_host_copies(meta_kind: str) -> None:
    attn, x, cos, sin, ctx = sparse_layer_inputs(meta_kind)
    out = run_fake_module(attn, x, cos, sin, ctx)
    assert out.shape == x.shape
    outs = []
    for metas in (ctx.attn_metadata, {g: with_stale_host_copies(m) for g, m in ctx.attn_metadata.items()}):
        caches = {n: c.clone() for n, c in ctx.kv_caches.items()}
        with torch.no_grad():
            outs.append(attn(x, cos, sin, replace(ctx, attn_metadata=metas, kv_caches=caches)))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(
    "host_read",
    [
        lambda m: int(m.query_start_loc_cpu[m.num_reqs]),
        lambda m: m.seq_lens.tolist(),
        lambda m: torch.nonzero(m.slot_mapping >= 0),
        lambda m: m.block_table[m.block_table > 0],
    ],
    ids=["int_of_host_copy", "tolist", "nonzero", "boolean_mask"],
)
def test_checker_catches_host_syncs(host_read: Callable[[AttentionMetadata], Any]) -> None:
    """Negative control: the fake metadata really rejects the reads a graph cannot hold (the former
    backend split tokens by ``int(query_start_loc_cpu[...])`` and ``torch.nonzero``)."""
    host_read(mixed_meta())  # fine on real tensors
    mode = FakeTensorMode()
    meta = fake_meta(mode, mixed_meta())
    with mode, pytest.raises(HOST_SYNC_ERRORS):
        host_read(meta)
