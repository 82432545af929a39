"""DeepSeek-V3 (MLA + MoE), DeepSeek-V3.2 (sparse MLA) and the Bamba hybrid through the real engine
(scheduler, KV cache manager, runner) against transformers on the same weights, and speculative
decoding on the hybrid: greedy output never changes, a model drafting for itself accepts all."""

from __future__ import annotations

import random
from functools import cache

import pytest
import torch

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.engine import LLMEngine
from warmcap.models.presets import resolve_model
from warmcap.sampling_params import SamplingParams

NEW_TOKENS = 32
# Around the 16-token block boundary; with an 20-token step budget the long ones prefill in chunks.
PROMPT_LENS = (5, 17, 33)
MODES = ("none", "all", "align")


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]


@cache
def _hf_reference(name: str) -> tuple[tuple[list[int], ...], tuple[torch.Tensor, ...]]:
    """transformers' greedy tokens and first-token logits per prompt (eager attention, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(resolve_model(name)), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in _prompts():
            out = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            logits.append(out.logits[0][0].float())
    return tuple(tokens), tuple(logits)


def _engine(name: str, *, mode: str = "none", spec: str | None = None, budget: int = 20) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=name, dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=96, mamba_cache_mode=mode),
        scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=budget, max_model_len=128),
        speculative=SpeculativeConfig.parse(spec),
    )
    return LLMEngine(config, startup_hooks=[])


def _run(engine: LLMEngine) -> tuple[list[list[int]], dict[int, torch.Tensor]]:
    """Two requests first, the third joins after three steps (mid-prefill of the others)."""
    first_logits: dict[str, torch.Tensor] = {}

    def hook(req_ids, num_logits, logits):
        row = 0
        for req_id, n in zip(req_ids, num_logits.tolist(), strict=True):
            if n:
                first_logits.setdefault(req_id, logits[row].clone())
            row += n

    engine.runner.logits_hook = hook
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _prompts()
    ids = [engine.add_request(prompts[0], params), engine.add_request(prompts[1], params)]
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == 3:
            ids.append(engine.add_request(prompts[2], params))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        steps += 1
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.num_blocks - 1
    return [done[i] for i in ids], {i: first_logits[r] for i, r in enumerate(ids)}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "mode"),
    [("tiny-deepseek-v3", "none"), *[("tiny-hybrid", m) for m in MODES]],
)
def test_engine_matches_transformers_logits_and_greedy(name: str, mode: str) -> None:
    engine = _engine(name, mode=mode)
    want_tokens, want_logits = _hf_reference(name)
    got_tokens, got_logits = _run(engine)
    for i, tokens in enumerate(got_tokens):
        assert tokens == want_tokens[i], f"{name}/{mode} prompt {i}"
        diff = (got_logits[i] - want_logits[i]).abs().max().item()
        assert diff <= 1e-4, f"{name}/{mode} prompt {i}: max |logit diff| {diff}"


@pytest.mark.slow
def test_sparse_mla_engine_matches_transformers_greedy() -> None:
    """tiny-deepseek-v32 keeps 8 tokens per query: prompts of 17 and 33 tokens are truly sparse."""
    engine = _engine("tiny-deepseek-v32")
    want_tokens, _ = _hf_reference("tiny-deepseek-v32")
    got_tokens, _ = _run(engine)
    assert got_tokens == list(want_tokens)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "spec"),
    [
        ("none", "draft_model:2@self"),
        ("align", "draft_model:3@self"),
        ("all", "ngram:2"),
        ("align", "eagle:2"),
    ],
)
def test_spec_decode_on_the_hybrid_keeps_greedy_output(mode: str, spec: str) -> None:
    want, _ = _hf_reference("tiny-hybrid")
    engine = _engine("tiny-hybrid", mode=mode, spec=spec)
    got, _ = _run(engine)
    assert got == list(want)
    metrics = engine.spec_metrics
    if spec.startswith("draft_model"):
        # The target drafting for itself: every draft is accepted (acceptance length 1 + k).
        assert metrics.num_draft_tokens > 0
        assert metrics.num_accepted_tokens == metrics.num_draft_tokens


@pytest.mark.parametrize("mode", MODES)
def test_hybrid_refuses_prefix_caching_asked_for_and_defaults_it_off(mode: str) -> None:
    """Asked for explicitly, prefix caching on the hybrid is a start-up error naming the Mamba
    cache mode; left to the default it is off, with the reason on the KV cache manager."""
    from warmcap.errors import ConfigError

    config = EngineConfig(
        model=ModelConfig(model="tiny-hybrid", dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=96, mamba_cache_mode=mode, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=20, max_model_len=128),
    )
    with pytest.raises(ConfigError, match=f"cache mode {mode!r}.*enable_prefix_caching=False"):
        LLMEngine(config, startup_hooks=[])
    kv = _engine("tiny-hybrid", mode=mode).kv_cache_manager
    assert not kv.enable_caching and f"cache mode {mode!r}" in kv.caching_off_reason
