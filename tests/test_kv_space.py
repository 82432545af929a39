"""A server-sized engine (vLLM's CPU server limits: 128 sequences, 2048 tokens a step) on a fixed KV
space too small for its seats: admission and preemption follow the blocks actually free, and every
request still gets the text a roomy engine gives it."""

from __future__ import annotations

from warmcap.llm import LLM
from warmcap.sampling_params import SamplingParams

MODEL = "tiny-llama"
SERVING = {"max_num_seqs": 128, "max_num_batched_tokens": 2048, "device": "cpu", "enforce_eager": True}
#: tiny-llama's KV block (16 tokens) is 8 KiB: this space holds 40 blocks, the null block included
SMALL_SPACE_GIB = 40 * 8192 / (1 << 30)
PROMPTS = [f"Request {i}: count from {i} upwards, {i}, {i + 1}," for i in range(24)]


def test_a_small_space_serves_every_seat_by_preempting_and_gives_the_roomy_engines_text() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    small = LLM(MODEL, kv_cache_space=SMALL_SPACE_GIB, **SERVING)
    assert small.engine.num_blocks == 40
    got = small.generate(PROMPTS, params)
    # 24 requests of ~40 tokens need ~72 blocks at once: the scheduler admitted what fit and preempted
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.kv_cache_manager.pool.num_free_blocks == small.engine.num_blocks - 1
    small.engine.shutdown()
    roomy = LLM(MODEL, max_model_len=256, **SERVING)
    want = roomy.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(len(o.outputs[0].token_ids) == 24 for o in got)
