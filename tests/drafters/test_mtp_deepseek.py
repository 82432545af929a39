"""mtp on a DeepSeek checkpoint that carries its MTP layer (``num_nextn_predict_layers=1``): the
drafter is that layer (MLA over its own latent group ``draft.mla``, MoE), loaded from the checkpoint;
greedy output equals no speculation; proposals equal a full-recompute reference; writes stay held."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from spec_rig import BLOCK_SIZE, TINY_VOCAB, SpecRig, force_acceptance, prompts

from warmcap.contracts import AttentionMetadata, ForwardContext
from warmcap.core.kv_spec import MLASpec
from warmcap.core.reservation import blocks_covering
from warmcap.drafters.heads import DeepseekMTPHead
from warmcap.runner_v2.attention.context import StepContext
from warmcap.runner_v2.attention.selector import backend_registry
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention

MODEL = "tiny-deepseek-v3"


def _dense_context(layer_names: list[str], spec: MLASpec, n: int) -> ForwardContext:
    """One request of ``n`` tokens computed from position 0 in one pass over fresh caches."""
    bs, num_blocks = spec.block_size, int(blocks_covering(n, spec.block_size))
    qsl, seq = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    meta = AttentionMetadata(
        num_tokens=n,
        num_reqs=1,
        query_start_loc=qsl,
        seq_lens=seq,
        block_table=torch.arange(1, num_blocks + 1, dtype=torch.int32)[None],
        slot_mapping=torch.arange(n, dtype=torch.int64) + bs,  # block j + 1 holds positions of column j
        max_query_len=n,
        max_seq_len=n,
        block_size=bs,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
    )
    caches = {name: torch.zeros(num_blocks + 1, bs, spec.head_size) for name in layer_names}
    return StepContext(
        {"mla": meta},
        dict.fromkeys(layer_names, "mla"),
        caches,
        backend_registry(TorchPagedAttention()),
        {"mla": "mla"},
    )


@torch.inference_mode()
def _reference_mtp(head: DeepseekMTPHead, target, tokens: list[int], k: int) -> list[int]:
    """Position p pairs the target state at p with token p + 1; each draft appends the head's own
    output; everything recomputed from position 0 every time."""
    cfg = target.hf_config
    spec = MLASpec(BLOCK_SIZE, kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim)
    target_layers = [layer.self_attn.layer_name for layer in target.model.layers]
    n = len(tokens) - 1
    ctx = _dense_context(target_layers, spec, n)
    states = target.forward(torch.tensor(tokens[:-1]), torch.arange(n), ctx)
    ids, drafts = list(tokens[1:]), []
    for _ in range(k):
        ctx = _dense_context(head.kv_layer_names, spec, len(ids))
        out = head.step(torch.tensor(ids), torch.arange(len(ids)), states, ctx)
        draft = int(head.draft_tokens(out[-1:]))
        drafts.append(draft)
        ids.append(draft)
        states = torch.cat([states, out[-1:]])
    return drafts


def test_mtp_drafter_is_the_checkpoints_mtp_layer_with_its_own_latent_group() -> None:
    rig = SpecRig(model_name=MODEL, spec="mtp:2", record=False)
    head = rig.drafter.head
    assert isinstance(head, DeepseekMTPHead)
    path = rig.engine.model_path
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert torch.equal(head.eh_proj.weight, f.get_tensor("model.layers.3.eh_proj.weight"))
        assert torch.equal(
            head.layer.mlp.experts.up_proj[5], f.get_tensor("model.layers.3.mlp.experts.5.up_proj.weight")
        )
        assert torch.equal(
            head.layer.self_attn.kv_b_proj.weight, f.get_tensor("model.layers.3.self_attn.kv_b_proj.weight")
        )
    drafts = [g for g in rig.engine.kv_groups if g.is_drafter]
    assert [(g.name, g.layer_names) for g in drafts] == [("draft.mla", ("draft.model.layers.3.self_attn",))]
    assert isinstance(drafts[0].spec, MLASpec)


@pytest.mark.slow
def test_mtp_greedy_output_equals_no_speculation_and_writes_stay_held() -> None:
    ps = prompts(TINY_VOCAB, (14, 30, 5), seed=3)
    joins = {0: [("a", ps[0], 24), ("b", ps[1], 20)], 2: [("c", ps[2], 24)]}
    plain = SpecRig(model_name=MODEL, record=False).run(joins)
    rig = SpecRig(model_name=MODEL, spec="mtp:2")
    assert rig.run(joins) == plain
    assert rig.metrics.num_draft_tokens > 0
    assert rig.stray_writes() == []
    assert {rec.phase for rec in rig.runner.kv_write_log.records} >= {"draft_prefill", "draft_step_1"}


@pytest.mark.slow
def test_mtp_proposals_equal_the_full_recompute_reference() -> None:
    rig = SpecRig(model_name=MODEL, spec="mtp:2", record=False)
    force_acceptance(rig)
    ps = prompts(TINY_VOCAB, (14, 30), seed=5)
    rig.run({0: [("a", ps[0], 12)], 1: [("b", ps[1], 10)]})
    assert rig.metrics.accepted_per_pos[0] > 0, "forced acceptance must exercise accepted drafts"
    assert rig.metrics.num_accepted_tokens < rig.metrics.num_draft_tokens, "and rejections"
    assert max(len(tokens) for _, tokens, _ in rig.proposals) > 32
    for req_id, tokens, drafts in rig.proposals:
        expected = _reference_mtp(rig.drafter.head, rig.model, tokens, 2)
        assert drafts == expected[: len(drafts)], f"{req_id} after {len(tokens)} tokens"
