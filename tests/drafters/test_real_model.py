"""I5 on the real SmolLM2-135M checkpoint: greedy output with speculation equals greedy output
without it, through ``LLM`` (chunked prefill, a prompt crossing block boundaries)."""

from __future__ import annotations

import pytest

from warmcap.llm import LLM
from warmcap.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Repeat after me: red green blue, red green blue, red green blue, red green",
    "Write one sentence about the sea.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Graphs off: exactness through captured graphs is covered in tests/graphs; here it is the drafters.
KWARGS = {
    "device": "cpu",
    "max_model_len": 256,
    "max_num_batched_tokens": 24,
    "num_blocks": 96,
    "enforce_eager": True,
}


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    return [o.token_ids for o in LLM("smollm2-135m", **KWARGS).generate(PROMPTS, GREEDY)]


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize(
    "spec", ["ngram:4", "draft_model:2@self", "eagle:2", "eagle3:2", "mtp:2", "dflash:2"]
)
def test_smollm2_speculative_greedy_equals_plain_greedy(spec: str, baseline: list[list[int]]) -> None:
    llm = LLM("smollm2-135m", speculative_config=spec, **KWARGS)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == baseline
    metrics = llm.engine.spec_metrics
    assert metrics.num_drafts > 0
    if spec.startswith("draft_model"):
        assert metrics.acceptance_length == 3.0
