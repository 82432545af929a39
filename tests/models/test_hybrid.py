"""Bamba (Mamba2 + attention) against transformers, for every Mamba cache mode, with chunked mixed
prefills, decodes and speculative verify steps that roll the Mamba state back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from paged_harness import PagedHarness, greedy_decode, hf_greedy, hf_last_logits, hf_model

from warmcap.contracts.mamba_layout import state_views
from warmcap.core.kv_spec import MambaSpec
from warmcap.models.hybrid import BambaForCausalLM
from warmcap.models.loader import load_model
from warmcap.models.presets_extra import make_tiny_hybrid

PROMPTS = {
    "a": [5, 17, 99, 3, 250, 41, 7, 300, 12, 8, 77, 19, 4, 61, 90, 23, 150, 6, 2],
    "b": [400, 2, 33, 71, 9],
}
BLOCK_SIZE = 4
MODES = ("none", "all", "align")


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-hybrid")
    make_tiny_hybrid(path)
    return path


@pytest.fixture(scope="module")
def models(hybrid_dir: Path) -> tuple[BambaForCausalLM, torch.nn.Module]:
    return load_model(hybrid_dir), hf_model(hybrid_dir)


@pytest.fixture(scope="module")
def hf_tokens(models: tuple) -> dict[str, list[int]]:
    """transformers' greedy 32 tokens per prompt (computed once for every mode)."""
    return {req_id: hf_greedy(models[1], prompt, 32) for req_id, prompt in PROMPTS.items()}


def harness(model: BambaForCausalLM, mode: str, *, k: int = 0, seed: int = 0) -> PagedHarness:
    specs = model.kv_layer_specs(BLOCK_SIZE, mamba_cache_mode=mode, num_speculative_blocks=k)
    return PagedHarness(model, specs, seed=seed)


@pytest.mark.parametrize("mode", MODES)
def test_chunked_mixed_prefill_matches_transformers(models: tuple, mode: str) -> None:
    ours, ref = models
    h = harness(ours, mode, seed=1)
    a, b = PROMPTS["a"], PROMPTS["b"]
    h.step([("a", a[:7], 0), ("b", b[:2], 0)])
    logits_b = h.step([("b", b[2:], 0), ("a", a[7:10], 0)])[len(b) - 3]
    logits_a = h.step([("a", a[10:], 0)])[-1]
    for req_id, logits in (("a", logits_a), ("b", logits_b)):
        diff = (logits - hf_last_logits(ref, PROMPTS[req_id])).abs().max().item()
        assert diff <= 1e-4, f"{mode}/{req_id}: max |diff| {diff}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_greedy_32_tokens_match_transformers_generate(models: tuple, hf_tokens: dict, mode: str) -> None:
    got = greedy_decode(harness(models[0], mode, seed=2), PROMPTS, 32, chunk=6)
    for req_id in PROMPTS:
        assert got[req_id] == hf_tokens[req_id], f"{mode}/{req_id}"


@pytest.mark.parametrize("mode", MODES)
def test_spec_verify_rolls_mamba_state_back_to_the_accepted_position(
    models: tuple, hf_tokens: dict, mode: str
) -> None:
    """Verify steps with partly wrong drafts (k=2): greedy output still equals transformers'."""
    prompt, k, n = PROMPTS["a"], 2, 14
    expected = hf_tokens["a"][:n]
    h = harness(models[0], mode, k=k, seed=3)
    out = [int(h.step([("r", prompt, 0)])[-1].argmax())]
    step = 0
    while len(out) < n:
        # Alternate: first draft right and second wrong, then both wrong; drafts never equal the truth.
        truth = expected[len(out) : len(out) + k]
        drafts = [truth[0], (truth[1] + 1) % 512] if step % 2 == 0 and len(truth) == k else [1, 2]
        logits = h.step([("r", [out[-1], *drafts], k)])
        predicted = logits.argmax(-1).tolist()
        accepted = 1
        while accepted <= k and predicted[accepted - 1] == drafts[accepted - 1]:
            accepted += 1
        h.accept("r", accepted)
        out += [*drafts[: accepted - 1], predicted[accepted - 1]]
        step += 1
    assert out[:n] == expected


def test_all_mode_keeps_a_state_at_every_block_boundary(models: tuple) -> None:
    """Mode ``all``: after one prefill, column j holds the state a fresh prefill of (j+1) blocks ends in."""
    ours, _ = models
    prompt = PROMPTS["a"][:13]
    h = harness(ours, "all", seed=4)
    h.step([("r", prompt, 0)])
    layer = "model.layers.0.mamba"
    spec = h.groups[[g.name for g in h.groups].index(h.layer_to_group[layer])].spec
    assert isinstance(spec, MambaSpec)
    views = state_views(h.caches[layer], spec.state_shapes)
    blocks = h.requests["r"].blocks[h.layer_to_group[layer]]
    for j in range(len(prompt) // BLOCK_SIZE):
        fresh = harness(ours, "all", seed=5 + j)
        fresh.step([("r", prompt[: (j + 1) * BLOCK_SIZE], 0)])
        fresh_block = fresh.requests["r"].blocks[fresh.layer_to_group[layer]][j]
        fresh_views = state_views(fresh.caches[layer], spec.state_shapes)
        for got, want in zip(views, fresh_views, strict=True):
            torch.testing.assert_close(got[blocks[j]], want[fresh_block], atol=1e-5, rtol=1e-5)


def test_mamba_specs_follow_the_requested_mode(models: tuple) -> None:
    ours, _ = models
    specs = ours.kv_layer_specs(16, mamba_cache_mode="align", num_speculative_blocks=3)
    mamba = specs["model.layers.0.mamba"]
    assert isinstance(mamba, MambaSpec)
    assert (mamba.cache_mode, mamba.num_speculative_blocks) == ("align", 3)
    assert mamba.state_shapes == ((128 + 2 * 2 * 16, 3), (8, 16, 16))
    assert specs["model.layers.1.self_attn"].kind == "full"
