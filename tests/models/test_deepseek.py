"""DeepSeek-V3 (MLA + MoE) and V3.2 (sparse MLA) against transformers on the same tiny weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from paged_harness import PagedHarness, greedy_decode, hf_greedy, hf_last_logits, hf_model

from warmcap.models.deepseek_v3 import DeepseekV3ForCausalLM
from warmcap.models.loader import load_model
from warmcap.models.presets_extra import make_tiny_deepseek_v3, make_tiny_deepseek_v32
from warmcap.runner_v2.attention.mla import TorchMLABackend

PROMPTS = {"a": [5, 17, 99, 3, 250, 41, 7, 300, 12, 8, 77, 19, 4], "b": [400, 2, 33, 71, 9, 128, 64]}
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-deepseek-v3")
    make_tiny_deepseek_v3(path)
    return path


@pytest.fixture(scope="module")
def v32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-deepseek-v32")
    make_tiny_deepseek_v32(path, index_topk=6)
    return path


def chunked_last_logits(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Prefill both prompts in a mixed, chunked batch crossing block boundaries; last logits."""
    harness = PagedHarness(model, model.kv_layer_specs(BLOCK_SIZE), seed=seed)
    a, b = PROMPTS["a"], PROMPTS["b"]
    harness.step([("a", a[:6], 0), ("b", b[:3], 0)])
    logits = harness.step([("b", b[3:], 0), ("a", a[6:], 0)])
    return {"b": logits[len(b) - 4], "a": logits[-1]}


def test_v3_chunked_mixed_prefill_matches_transformers(v3_dir: Path) -> None:
    ours, ref = load_model(v3_dir), hf_model(v3_dir)
    got = chunked_last_logits(ours, seed=1)
    for req_id, logits in got.items():
        diff = (logits - hf_last_logits(ref, PROMPTS[req_id])).abs().max().item()
        assert diff <= 1e-4, f"{req_id}: max |diff| {diff}"


@pytest.mark.slow
def test_v3_greedy_32_tokens_match_transformers_generate(v3_dir: Path) -> None:
    ours, ref = load_model(v3_dir), hf_model(v3_dir)
    got = greedy_decode(PagedHarness(ours, ours.kv_layer_specs(BLOCK_SIZE), seed=2), PROMPTS, 32, chunk=5)
    for req_id, prompt in PROMPTS.items():
        assert got[req_id] == hf_greedy(ref, prompt, 32)


def test_absorbed_decode_equals_decompressed_path(v3_dir: Path) -> None:
    model: DeepseekV3ForCausalLM = load_model(v3_dir)
    results = []
    for threshold in (0, 10**6):  # never absorbed / always absorbed
        harness = PagedHarness(model, model.kv_layer_specs(BLOCK_SIZE), seed=3)
        harness.backends.register("mla", TorchMLABackend(threshold))
        prefill = harness.step([("a", PROMPTS["a"], 0), ("b", PROMPTS["b"], 0)])
        decode = harness.step([("a", [11], 0), ("b", [23], 0)])
        results.append((prefill, decode))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5, rtol=0)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-5, rtol=0)


def test_v32_sparse_matches_transformers(v32_dir: Path) -> None:
    """top-k (6) smaller than the context: indexer selection and masked MLA match transformers."""
    ours, ref = load_model(v32_dir), hf_model(v32_dir)
    assert all(layer.self_attn.indexer.top_k == 6 for layer in ours.model.layers)
    got = chunked_last_logits(ours, seed=4)
    for req_id, logits in got.items():
        diff = (logits - hf_last_logits(ref, PROMPTS[req_id])).abs().max().item()
        assert diff <= 1e-4, f"{req_id}: max |diff| {diff}"
    decoded = greedy_decode(PagedHarness(ours, ours.kv_layer_specs(BLOCK_SIZE), seed=5), PROMPTS, 12, chunk=5)
    for req_id, prompt in PROMPTS.items():
        assert decoded[req_id] == hf_greedy(ref, prompt, 12)


def test_v32_with_topk_covering_context_equals_dense_mla(v32_dir: Path) -> None:
    model = load_model(v32_dir)
    for layer in model.model.layers:
        layer.self_attn.indexer.top_k = 64
    sparse = chunked_last_logits(model, seed=6)
    indexers = [layer.self_attn.indexer for layer in model.model.layers]
    for layer in model.model.layers:
        layer.self_attn.indexer = None
    dense = chunked_last_logits(model, seed=6)
    for layer, indexer in zip(model.model.layers, indexers, strict=True):
        layer.self_attn.indexer = indexer
    for req_id in PROMPTS:
        assert torch.equal(sparse[req_id], dense[req_id])


def test_kv_layer_specs_give_mla_and_indexer_groups(v32_dir: Path, v3_dir: Path) -> None:
    from warmcap.core.kv_spec import IndexerSpec, MLASpec, group_layers

    v32 = load_model(v32_dir)
    groups = {g.name: g for g in group_layers(v32.kv_layer_specs(16))}
    assert set(groups) == {"mla", "indexer"}
    assert groups["mla"].spec == MLASpec(16, 4, kv_lora_rank=32, qk_rope_head_dim=16)
    assert groups["indexer"].spec == IndexerSpec(16, 4, head_size=32)
    assert groups["indexer"].layer_names[0] == "model.layers.0.self_attn.indexer"
    assert {g.name for g in group_layers(load_model(v3_dir).kv_layer_specs(16))} == {"mla"}
