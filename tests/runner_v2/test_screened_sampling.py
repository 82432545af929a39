"""The runner's use of the screened greedy head (``models/greedy_head.py``): only on steps that need
nothing but argmaxes, with tokens unchanged; every other step keeps the full float32 logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from warmcap.llm import LLM
from warmcap.models.greedy_head import ENV_SWITCH, GreedyHead, can_screen
from warmcap.runner_v2.sampler import row_argmax
from warmcap.sampling_params import SamplingParams

KWARGS = {"device": "cpu", "max_model_len": 256, "max_num_batched_tokens": 64, "num_blocks": 96}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


class CheckedHead:
    """The runner's screened head, checked on every batch it answers against ``row_argmax`` of
    the model's full float32 logits; counts the rows it answered."""

    def __init__(self, head: GreedyHead, model: torch.nn.Module) -> None:
        self.head, self.model = head, model
        self.rows = 0
        self.largest = 0

    def argmax(self, x: torch.Tensor, *, decline: bool = False) -> torch.Tensor | None:
        got = self.head.argmax(x, decline=decline)
        if got is not None:
            assert torch.equal(got, row_argmax(self.model.compute_logits(x)))
            self.rows += len(x)
            self.largest = max(self.largest, len(x))
        return got


def checked(llm: LLM) -> CheckedHead:
    runner = llm.engine.runner
    assert runner.greedy_head is not None
    spy = CheckedHead(runner.greedy_head, llm.engine.model)
    runner.greedy_head = spy
    return spy


def generate(llm: LLM, prompts: list, params: list[SamplingParams], *, screen: CheckedHead | None):
    runner = llm.engine.runner
    runner.greedy_head = screen
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


pytestmark = pytest.mark.usefixtures("screen_on_every_cpu")


@pytest.fixture(scope="module")
def tiny(screen_on_every_cpu: str) -> tuple[LLM, CheckedHead]:
    llm = LLM("tiny-llama", **KWARGS)
    return llm, checked(llm)


PROMPTS = [[5, 9, 13, 2, 7, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


def test_plain_greedy_steps_are_screened_with_the_same_tokens(tiny) -> None:
    llm, spy = tiny
    full, _ = generate(llm, PROMPTS, [GREEDY, GREEDY], screen=None)
    spy.rows = 0
    screened, _ = generate(llm, PROMPTS, [GREEDY, GREEDY], screen=spy)
    assert screened == full
    assert spy.rows == 2 * GREEDY.max_tokens  # every sampled row, no step left to the full logits


@pytest.mark.parametrize(
    "other",
    [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=0.7),
        SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True, seed=7),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12),
    ],
    ids=["logprobs", "repetition_penalty", "frequency_penalty", "temperature", "min_tokens"],
)
def test_a_request_that_needs_the_logits_keeps_its_step_on_the_full_path(tiny, other) -> None:
    llm, spy = tiny
    params = [GREEDY, other]
    full_tokens, full_logprobs = generate(llm, PROMPTS, params, screen=None)
    spy.rows = 0
    tokens, logprobs = generate(llm, PROMPTS, params, screen=spy)
    # both requests run all their steps together, so none of them is screened
    assert spy.rows == 0
    assert tokens == full_tokens
    assert logprobs == full_logprobs
    if other.logprobs is not None:
        assert len(logprobs[1]) == other.max_tokens and all(len(d) >= other.logprobs for d in logprobs[1])


def test_a_logits_hook_sees_every_step_and_disables_the_screen(tiny) -> None:
    llm, spy = tiny
    seen: list[int] = []
    llm.engine.runner.logits_hook = lambda req_ids, num_logits, logits: seen.append(len(logits))
    try:
        spy.rows = 0
        tokens, _ = generate(llm, PROMPTS, [GREEDY, GREEDY], screen=spy)
    finally:
        llm.engine.runner.logits_hook = None
    assert spy.rows == 0 and sum(seen) == 2 * GREEDY.max_tokens
    assert tokens == generate(llm, PROMPTS, [GREEDY, GREEDY], screen=None)[0]


def test_the_environment_switch_turns_the_screen_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert LLM("tiny-llama", **KWARGS).engine.runner.greedy_head is None
    monkeypatch.setenv(ENV_SWITCH, "1")
    # On by default exactly where oneDNN has a bf16 GEMM; the portable screen anywhere.
    assert isinstance(LLM("tiny-llama", **KWARGS).engine.runner.greedy_head, GreedyHead) == can_screen()
    monkeypatch.setenv(ENV_SWITCH, "portable")
    head = LLM("tiny-llama", **KWARGS).engine.runner.greedy_head
    assert isinstance(head, GreedyHead) and head.portable


def test_batch_invariant_heads_are_not_screened() -> None:
    llm = LLM("tiny-llama", batch_invariant=True, **KWARGS)
    assert llm.engine.runner.greedy_head is None


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_speculative_greedy_verifies_screened_argmaxes() -> None:
    """I5 with the screen: ngram drafts verified against screened argmaxes give plain greedy."""
    prompts = ["Repeat after me: red green blue, red green blue, red green blue, red green", "1, 2, 3, 4,"]
    plain = LLM("smollm2-135m", enforce_eager=True, **KWARGS)
    llm = LLM("smollm2-135m", speculative_config="ngram:3", enforce_eager=True, **KWARGS)
    spy = checked(llm)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.spec_metrics.num_drafts > 0
    assert spy.largest > len(prompts)  # verify steps were screened: 1 + k rows per request


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_benchmark_prompts_are_token_identical_with_and_without_the_screen() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_throughput import DEFAULT_PROMPTS, load_prompts, prompt_ids

    llm = LLM(
        "smollm2-135m", **{**KWARGS, "max_num_seqs": 16, "max_num_batched_tokens": 512, "num_blocks": 160}
    )
    ids = prompt_ids(llm.tokenizer, load_prompts(DEFAULT_PROMPTS, 16), chat=True)
    spy = checked(llm)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full, _ = generate(llm, ids, [params] * len(ids), screen=None)
    screened, _ = generate(llm, ids, [params] * len(ids), screen=spy)
    assert screened == full
    assert spy.rows == len(ids) * params.max_tokens
