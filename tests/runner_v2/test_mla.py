"""Paged MLA backend and sparse MLA layer against plain (unpaged) references written here."""

from __future__ import annotations

import random

import pytest
import torch

from warmcap.contracts import AttentionMetadata, MLAWeights
from warmcap.models.mla import MLAAttention, deinterleave
from warmcap.models.rope import RotaryEmbedding, apply_rope
from warmcap.runner_v2.attention.context import StepContext
from warmcap.runner_v2.attention.mla import TorchMLABackend
from warmcap.runner_v2.attention.selector import backend_registry
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention

BS, NUM_BLOCKS, HEADS, NOPE, ROPE, RANK, VDIM = 4, 32, 4, 8, 8, 16, 12


def draw_blocks(max_lens: list[int], seed: int) -> list[list[int]]:
    """Random distinct block ids, enough for each row's final length."""
    ids = list(range(1, NUM_BLOCKS + 1))
    random.Random(seed).shuffle(ids)
    return [[ids.pop() for _ in range(-(-n // BS))] for n in max_lens]


def make_meta(
    seq_lens: list[int], query_lens: list[int], blocks: list[list[int]], pad_tokens: int = 0
) -> AttentionMetadata:
    """Slots from the rows' blocks; ``pad_tokens`` PAD tokens in an extra padded row (seq_len 0)."""
    rows = len(seq_lens) + (1 if pad_tokens else 0)
    table = torch.zeros(rows, max(len(b) for b in blocks), dtype=torch.int32)
    slots, qsl = [], [0]
    for row, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        held = blocks[row][: -(-s // BS)]
        table[row, : len(held)] = torch.tensor(held, dtype=torch.int32)
        slots += [held[p // BS] * BS + p % BS for p in range(s - q, s)]
        qsl.append(qsl[-1] + q)
    if pad_tokens:
        slots += [-1] * pad_tokens
        qsl.append(qsl[-1] + pad_tokens)
    lens = torch.tensor([*seq_lens, *([0] if pad_tokens else [])], dtype=torch.int32)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    return AttentionMetadata(
        num_tokens=qsl[-1],
        num_reqs=rows,
        query_start_loc=qsl_t,
        seq_lens=lens,
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max([*query_lens, pad_tokens]),
        max_seq_len=max(seq_lens),
        block_size=BS,
        query_start_loc_cpu=qsl_t,
    )


def dense_mla(q_nope, q_pe, latent, weights: MLAWeights, scale: float, allowed=None) -> torch.Tensor:
    """One sequence, every token a query, no cache: decompress and attend causally."""
    c_kv, k_pe = latent[:, :RANK], latent[:, RANK:]
    k_nope = torch.einsum("sc,hdc->shd", c_kv, weights.w_uk)
    value = torch.einsum("sc,hvc->shv", c_kv, weights.w_uv)
    scores = (torch.einsum("thd,shd->hts", q_nope, k_nope) + torch.einsum("thd,sd->hts", q_pe, k_pe)) * scale
    mask = torch.ones(len(latent), len(latent), dtype=torch.bool).tril()
    if allowed is not None:
        mask &= allowed
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hts,shv->thv", probs, value)


@pytest.mark.parametrize("absorbed_max_query_len", [0, 1, 10**6])
def test_paged_mla_matches_dense_reference_for_mixed_chunks(absorbed_max_query_len: int) -> None:
    """Two sequences (lengths 11 and 6) fed as a prefill step then a mixed chunk + decode step, with a
    padded row: every query equals the dense reference whatever path (absorbed or not) it takes."""
    gen = torch.Generator().manual_seed(0)
    weights = MLAWeights(
        torch.randn(HEADS, NOPE, RANK, generator=gen), torch.randn(HEADS, VDIM, RANK, generator=gen)
    )
    seqs = [11, 6]
    q_nope = [torch.randn(n, HEADS, NOPE, generator=gen) for n in seqs]
    q_pe = [torch.randn(n, HEADS, ROPE, generator=gen) for n in seqs]
    latent = [torch.randn(n, RANK + ROPE, generator=gen) for n in seqs]
    backend = TorchMLABackend(absorbed_max_query_len)
    cache = torch.zeros(NUM_BLOCKS + 1, BS, RANK + ROPE)
    first, second = [7, 5], [4, 1]  # query lengths per step; step 2: a chunk and a decode
    blocks = draw_blocks(seqs, seed=1)
    outs = []
    for step, (qlens, ends) in enumerate(((first, first), (second, seqs))):
        meta = make_meta(ends, qlens, blocks, pad_tokens=2 if step else 0)
        spans = [slice(e - q, e) for e, q in zip(ends, qlens, strict=True)]
        pad = meta.num_tokens - sum(qlens)

        def cat(xs: list[torch.Tensor], spans: list[slice] = spans, pad: int = pad) -> torch.Tensor:
            return torch.cat([*(x[s] for x, s in zip(xs, spans, strict=True)), xs[0][:pad]])

        outs.append(backend.forward(cat(q_nope), cat(q_pe), cat(latent), cache, meta, weights, scale=0.3))
    assert torch.count_nonzero(cache[0]) == 0, "block 0 (null) was written"
    refs = [dense_mla(q_nope[i], q_pe[i], latent[i], weights, 0.3) for i in range(2)]
    torch.testing.assert_close(outs[0], torch.cat([refs[0][:7], refs[1][:5]]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[1][:5], torch.cat([refs[0][7:], refs[1][5:]]), atol=1e-4, rtol=1e-4)
    assert torch.count_nonzero(outs[1][5:]) == 0, "padded tokens must give zeros"


def test_allowed_mask_restricts_attention_like_the_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    weights = MLAWeights(
        torch.randn(HEADS, NOPE, RANK, generator=gen), torch.randn(HEADS, VDIM, RANK, generator=gen)
    )
    n = 9
    q_nope, q_pe = torch.randn(n, HEADS, NOPE, generator=gen), torch.randn(n, HEADS, ROPE, generator=gen)
    latent = torch.randn(n, RANK + ROPE, generator=gen)
    allowed = torch.rand(n, n, generator=gen) < 0.5
    allowed |= torch.eye(n, dtype=torch.bool)
    meta = make_meta([n], [n], draw_blocks([n], seed=2))
    for threshold in (0, 10**6):
        cache = torch.zeros(NUM_BLOCKS + 1, BS, RANK + ROPE)
        got = TorchMLABackend(threshold).forward(
            q_nope, q_pe, latent, cache, meta, weights, scale=0.2, allowed=allowed
        )
        torch.testing.assert_close(
            got, dense_mla(q_nope, q_pe, latent, weights, 0.2, allowed), atol=1e-4, rtol=1e-4
        )


def _sparse_config(index_topk: int):
    from transformers import DeepseekV32Config

    return DeepseekV32Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=24, kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=VDIM,
        index_topk=index_topk, index_n_heads=4, index_head_dim=16, n_routed_experts=4, n_group=1, topk_group=1,
        max_position_embeddings=256,
    )  # fmt: skip


def reference_sparse_mla(
    attn: MLAAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """One whole sequence, no paging: lightning-indexer top-k, then MLA over the selected tokens."""
    n, ix = x.shape[0], attn.indexer
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    q_nope, q_pe = attn.q_b_proj(q_resid).view(n, HEADS, NOPE + ROPE).split([NOPE, ROPE], -1)
    c_kv, k_pe = attn.kv_a_proj_with_mqa(x).split([RANK, ROPE], -1)
    latent = torch.cat(
        (attn.kv_a_layernorm(c_kv), apply_rope(deinterleave(k_pe[:, None]), cos, sin)[:, 0]), -1
    )
    iq = ix.wq_b(q_resid).view(n, ix.num_heads, ix.head_dim)
    ik = ix.k_norm(ix.wk(x))
    iq = torch.cat((apply_rope(iq[..., :ROPE], cos, sin), iq[..., ROPE:]), -1)
    ik = torch.cat((apply_rope(ik[:, None, :ROPE], cos, sin)[:, 0], ik[:, ROPE:]), -1)
    w = ix.weights_proj(x) * ix.num_heads**-0.5
    scores = torch.zeros(n, n)
    for t in range(n):
        for s in range(t + 1):
            scores[t, s] = sum(
                w[t, h] * torch.relu(iq[t, h] @ ik[s] * ix.head_dim**-0.5) for h in range(ix.num_heads)
            )
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for t in range(n):
        best = sorted(range(t + 1), key=lambda s, t=t: -float(scores[t, s]))[: ix.top_k]
        allowed[t, best] = True
    weights = MLAWeights.from_kv_b_proj(attn.kv_b_proj.weight, HEADS, NOPE)
    out = dense_mla(q_nope, apply_rope(deinterleave(q_pe), cos, sin), latent, weights, attn.scale, allowed)
    return attn.o_proj(out.reshape(n, HEADS * VDIM))


@pytest.mark.parametrize("index_topk", [3, 64])
def test_sparse_mla_layer_matches_plain_reference(index_topk: int) -> None:
    """Prefill of 10 tokens in two chunks through the MLA and indexer groups (different block ids)."""
    torch.manual_seed(2)
    config = _sparse_config(index_topk)
    attn = MLAAttention(config, 0)
    backends = backend_registry(TorchPagedAttention())
    n = 10
    x = torch.randn(n, 32)
    rotary = RotaryEmbedding.from_config(config, ROPE)
    cos, sin = rotary.cos_sin(torch.arange(n), torch.float32)
    caches = {
        attn.layer_name: torch.zeros(NUM_BLOCKS + 1, BS, RANK + ROPE),
        attn.indexer.layer_name: torch.zeros(NUM_BLOCKS + 1, BS, 16),
    }
    groups = {attn.layer_name: "mla", attn.indexer.layer_name: "indexer"}
    mla_blocks, index_blocks = draw_blocks([n], seed=3), draw_blocks([n], seed=4)
    outs = []
    with torch.no_grad():
        for span in (slice(0, 6), slice(6, n)):
            q = span.stop - span.start
            metas = {
                "mla": make_meta([span.stop], [q], mla_blocks),
                "indexer": make_meta([span.stop], [q], index_blocks),
            }
            ctx = StepContext(metas, groups, caches, backends, {"mla": "mla", "indexer": "indexer"})
            outs.append(attn(x[span], cos[span], sin[span], ctx))
        want = reference_sparse_mla(attn, x, cos, sin)
        attn.indexer.top_k = n
        dense = reference_sparse_mla(attn, x, cos, sin)
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-4, rtol=1e-4)
    # top-k below the context must actually drop tokens; at or above it the layer is dense MLA.
    assert torch.allclose(want, dense, atol=1e-6) == (index_topk >= n)


@pytest.mark.parametrize("absorbed_max_query_len", [0, 1, 2])
def test_uniform_decode_batch_with_a_padded_row_matches_dense_reference(absorbed_max_query_len: int) -> None:
    """A verify-shaped step (two queries per row, as with one draft token) padded by a row of two PAD
    tokens, after a prefill: thresholds 0 and 1 take the decompressed path for the whole batch, 2 the
    absorbed one; either way every real query equals the dense reference and padded queries give 0."""
    gen = torch.Generator().manual_seed(5)
    weights = MLAWeights(
        torch.randn(HEADS, NOPE, RANK, generator=gen), torch.randn(HEADS, VDIM, RANK, generator=gen)
    )
    seqs = [9, 6]
    q_nope = [torch.randn(n, HEADS, NOPE, generator=gen) for n in seqs]
    q_pe = [torch.randn(n, HEADS, ROPE, generator=gen) for n in seqs]
    latent = [torch.randn(n, RANK + ROPE, generator=gen) for n in seqs]
    backend = TorchMLABackend(absorbed_max_query_len)
    cache = torch.zeros(NUM_BLOCKS + 1, BS, RANK + ROPE)
    blocks = draw_blocks(seqs, seed=6)
    prefill = make_meta([n - 2 for n in seqs], [n - 2 for n in seqs], blocks)
    backend.forward(
        *(torch.cat([x[: n - 2] for x, n in zip(xs, seqs, strict=True)]) for xs in (q_nope, q_pe, latent)),
        cache,
        prefill,
        weights,
        scale=0.3,
    )
    verify = make_meta(seqs, [2, 2], blocks, pad_tokens=2)
    assert verify.max_query_len == 2
    step = [
        torch.cat([*(x[n - 2 :] for x, n in zip(xs, seqs, strict=True)), xs[0][:2]])
        for xs in (q_nope, q_pe, latent)
    ]
    out = backend.forward(*step, cache, verify, weights, scale=0.3)
    refs = [dense_mla(q_nope[i], q_pe[i], latent[i], weights, 0.3)[-2:] for i in range(2)]
    torch.testing.assert_close(out[:4], torch.cat(refs), atol=1e-4, rtol=1e-4)
    assert torch.count_nonzero(out[4:]) == 0, "padded tokens must give zeros"
