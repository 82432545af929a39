"""The engine against transformers on the same weights: greedy tokens and prompt-final logits, with
chunked prefill, block-boundary prompts, requests joining and leaving, and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from warmcap.engine import LLMEngine, RequestOutput
from warmcap.errors import ConfigError
from warmcap.llm import LLM
from warmcap.models.presets import resolve_model
from warmcap.sampling_params import SamplingParams
from warmcap.startup_hooks import hook_name

NEW_TOKENS = 32
# Lengths around the 16-token block boundary; the longest outgrows tiny-mistral's 24-token window.
PROMPT_LENS = (5, 16, 17, 33, 40)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


def _hf_reference(path, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokens, logits = [], []
    for prompt in prompts:
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
    return tokens, logits


def _engine(
    name: str, *, num_blocks: int = 256, max_tokens_per_step: int = 24, prefill_cap: int | None = None
) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=name, dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=max_tokens_per_step,
            max_model_len=128,
            max_prefill_tokens_with_decodes=prefill_cap,
        ),
    )
    return LLMEngine(config)


def _run_staggered(
    engine: LLMEngine, prompts: list[list[int]]
) -> tuple[dict[int, RequestOutput], dict[int, torch.Tensor]]:
    """Two requests first, the rest join after three steps; every other one stops early."""
    first_logits: dict[str, torch.Tensor] = {}

    def hook(req_ids, num_logits, logits):
        for i, req_id in enumerate(r for r, n in zip(req_ids, num_logits, strict=True) if n):
            first_logits.setdefault(req_id, logits[i].clone())

    engine.runner.logits_hook = hook
    lengths = [NEW_TOKENS if i % 2 == 0 else NEW_TOKENS // 2 + i for i in range(len(prompts))]
    ids: dict[str, int] = {}

    def add(i: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True)
        ids[engine.add_request(prompts[i], params)] = i

    add(0)
    add(1)
    done: dict[int, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == 3:
            for i in range(2, len(prompts)):
                add(i)
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out
        steps += 1
    assert len(done) == len(prompts)
    return done, {ids[r]: t for r, t in first_logits.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"])
def test_greedy_and_logits_match_transformers(name: str) -> None:
    engine = _engine(name)
    prompts = _prompts(engine.model.hf_config.vocab_size)
    expected, expected_logits = _hf_reference(engine.model_path, prompts)
    done, logits = _run_staggered(engine, prompts)
    for i, out in done.items():
        assert out.token_ids == expected[i][: len(out.token_ids)], f"prompt {i}"
        assert out.finish_reason == "length"
        torch.testing.assert_close(logits[i], expected_logits[i], atol=1e-4, rtol=1e-4)
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.num_blocks - 1


@pytest.mark.slow
def test_a_prompt_cap_beside_decodes_changes_the_steps_not_the_tokens() -> None:
    engine = _engine("tiny-llama", prefill_cap=5)
    prompts = _prompts(engine.model.hf_config.vocab_size)
    expected, expected_logits = _hf_reference(engine.model_path, prompts)
    steps: list[tuple[int, int]] = []  # (prompt tokens, decode rows) of every step
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        requests = engine.scheduler.requests
        decoding = [
            d for d in out.scheduled_cached_reqs if d.num_computed_tokens >= requests[d.req_id].num_tokens - 1
        ]
        steps.append((out.total_num_scheduled_tokens - len(decoding), len(decoding)))
        return out

    engine.scheduler.schedule = recording
    done, logits = _run_staggered(engine, prompts)
    for i, out in done.items():
        assert out.token_ids == expected[i][: len(out.token_ids)], f"prompt {i}"
        torch.testing.assert_close(logits[i], expected_logits[i], atol=1e-4, rtol=1e-4)
    # The late prompts joined two decodes five tokens a step; the first two shared the budget.
    assert steps[0] == (sum(len(p) for p in prompts[:2]), 0)
    beside = [p for p, d in steps if d and p]
    assert beside and max(beside) == 5
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.num_blocks - 1


@pytest.mark.slow
def test_preemption_keeps_outputs_identical_and_frees_every_block() -> None:
    reference = _engine("tiny-llama")
    prompts = _prompts(reference.model.hf_config.vocab_size)
    want, _ = _run_staggered(reference, prompts)
    # 10 usable blocks cannot hold five requests of up to 72 tokens (5 blocks each) at once.
    tight = _engine("tiny-llama", num_blocks=11)
    got, _ = _run_staggered(tight, prompts)
    assert tight.scheduler.num_preemptions > 0
    assert {i: o.token_ids for i, o in got.items()} == {i: o.token_ids for i, o in want.items()}
    assert tight.kv_cache_manager.pool.num_free_blocks == tight.num_blocks - 1
    tight.step()  # delivers the last finished ids to the runner
    assert tight.runner.batch.num_reqs == 0


def test_llm_api_text_stream_chat_abort_and_hooks() -> None:
    calls: list[str] = []
    with pytest.raises(ConfigError, match="block_size"):
        LLM("tiny-llama", max_num_seq=4)
    llm = LLM("tiny-llama", device="cpu", max_model_len=128, num_blocks=64, block_size=16)
    engine = llm.engine
    # start-up runs warmup then graph capture by default, and both leave their results behind
    assert [hook_name(h) for h in engine.startup_hooks] == ["warmup", "graph_capture"]
    assert engine.warmup_result.audit.ok and engine.graph_startup is not None
    LLMEngine(engine.config, startup_hooks=[lambda e: calls.append("a"), lambda e: calls.append("b")])
    assert calls == ["a", "b"]

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    [out] = llm.generate("The capital of France is", greedy)
    assert len(out.token_ids) == 8 and out.text == llm.tokenizer.decode(
        out.token_ids, skip_special_tokens=True
    )
    # the tokenizer's own special-token policy, as transformers and vLLM encode a text prompt
    assert out.prompt_token_ids == llm.tokenizer("The capital of France is").input_ids
    assert "".join(llm.generate_stream("The capital of France is", greedy)) == out.text
    chat = llm.chat([{"role": "user", "content": "hello"}], greedy)
    [templated] = llm.generate("hello", greedy, use_chat_template=True)
    assert chat.token_ids == templated.token_ids

    req = engine.add_request([5, 6, 7], SamplingParams(max_tokens=50))
    engine.step()
    assert engine.abort(req) and not engine.has_unfinished()
    engine.step()
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.num_blocks - 1
    assert engine.runner.batch.num_reqs == 0


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_greedy_matches_transformers() -> None:
    path = resolve_model("smollm2-135m")
    llm = LLM(str(path), device="cpu", max_model_len=256, max_num_batched_tokens=64, num_blocks=128)
    prompts = ["The capital of France is", "Write a haiku about rain.", "1, 2, 3, 4,"]
    ids = [llm.tokenizer(p).input_ids for p in prompts]
    expected, _ = _hf_reference(path, ids)
    # text prompts, encoded by the engine as transformers encodes them
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == ids
    assert [o.token_ids for o in outs] == expected


def test_engine_without_hooks_and_llm_with_enforce_eager_start_and_generate_alike() -> None:
    eager = LLM(
        "tiny-llama", device="cpu", max_model_len=128, num_blocks=64, block_size=16, enforce_eager=True
    )
    engine = eager.engine
    # Both default hooks ran: warmup did its work, graph capture declined (enforce_eager).
    assert set(engine.startup_results) == {"warmup", "graph_capture"}
    assert engine.warmup_result.audit.ok and engine.graph_startup is None and engine.runner.graphs is None
    bare = LLMEngine(engine.config, startup_hooks=[])
    assert bare.startup_results == {} and bare.warmup_result is None and bare.runner.graphs is None
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 2, 6], [8, 9, 7, 3, 1, 4]]
    got = [o.token_ids for o in eager.generate(prompts, greedy)]
    # Warmup leaves no trace, so the warmed engine generates what the bare one does.
    assert got == [o.token_ids for o in bare.generate(prompts, [greedy, greedy])]
    assert all(len(t) == 8 for t in got)


def test_startup_hooks_get_a_context_and_their_results_are_kept_by_name() -> None:
    seen = []

    def probe_hook(ctx):
        seen.append(ctx)
        return ctx.num_blocks - ctx.kv_cache_manager.pool.num_free_blocks

    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=32),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64),
    )
    engine = LLMEngine(config, startup_hooks=[probe_hook])
    [ctx] = seen
    assert ctx.runner is engine.runner and ctx.kv_cache_manager is engine.kv_cache_manager
    # Only the null block is in use before the first request.
    assert engine.startup_results == {"probe": 1}
    assert "probe" in engine.startup_timings


def test_attention_backend_is_chosen_by_the_config() -> None:
    """The backend a run asks for is the one full-attention layers get (scripts/gpu_check.py asks
    for flashinfer this way); an unknown name is refused before anything loads."""
    from warmcap.contracts.backends import AttentionBackend
    from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention

    llm = LLM("tiny-llama", device="cpu", attention_backend="torch", enforce_eager=True, num_blocks=64)
    assert isinstance(llm.engine.runner.backends.get("full", AttentionBackend), TorchPagedAttention)
    with pytest.raises(ConfigError, match="attention_backend 'paged' is unknown: use one of auto, torch"):
        LLM("tiny-llama", device="cpu", attention_backend="paged")
