"""``SamplingParams.output_kind``: which outputs ``LLMEngine.step`` returns, as vLLM defines them.

The oracle for ``DELTA`` and ``FINAL_ONLY`` is the same request run ``CUMULATIVE`` (seeded sampling,
one request at a time, so the tokens are the same): deltas must add up to its last output, and a
final-only request must return just that output.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from warmcap.engine import LLMEngine
from warmcap.errors import ConfigError
from warmcap.outputs import RequestOutput
from warmcap.sampling_params import RequestOutputKind, SamplingParams

PROMPT = [1, 45, 499, 173, 170, 299]
MAX_TOKENS = 48


@functools.cache
def _engine() -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256),
    )
    return LLMEngine(config, startup_hooks=[])


def _run(params: SamplingParams, prompt: list[int] = PROMPT) -> tuple[list[RequestOutput], list[int]]:
    """Every output ``step`` returns for one request run alone, and the token ids the tokenizer
    decoded in each step."""
    engine = _engine()
    req_id = engine.add_request(prompt, params)
    outs, decoded = [], []
    while engine.has_unfinished():
        before = engine.detokenizer.tokens_decoded
        outs += [o for o in engine.step() if o.request_id == req_id]
        decoded.append(engine.detokenizer.tokens_decoded - before)
    return outs, decoded


def _params(**kw: Any) -> SamplingParams:
    base: dict[str, Any] = dict(temperature=1.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    return SamplingParams(**{**base, **kw})


def test_delta_outputs_add_up_to_the_cumulative_output() -> None:
    settings = dict(logprobs=2, prompt_logprobs=1)

    def held_back(outs: list[RequestOutput]) -> bool:
        # one step's text ends in a character a later token completes (its U+FFFD is not in the
        # final text): the case a delta must hold back
        return any(not outs[-1].text.startswith(o.text) for o in outs)

    # the first seed whose random text has that case
    seed, cumulative = next(
        (s, outs) for s in range(13, 80) if held_back(outs := _run(_params(seed=s, **settings))[0])
    )
    deltas, _ = _run(_params(seed=seed, output_kind=RequestOutputKind.DELTA, **settings))
    last = cumulative[-1]
    assert last.finished and len(last.token_ids) == MAX_TOKENS
    assert len(deltas) == len(cumulative)
    assert "".join(o.text for o in deltas) == last.text
    assert [t for o in deltas for t in o.token_ids] == last.token_ids
    assert all(o.token_ids == o.new_token_ids for o in deltas)
    assert [lp for o in deltas for lp in o.outputs[0].logprobs] == last.outputs[0].logprobs
    # the prompt's logprobs come once, with the first output
    assert deltas[0].prompt_logprobs == last.prompt_logprobs is not None
    assert all(o.prompt_logprobs is None for o in deltas[1:])
    assert [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason == last.finish_reason == "length"


@pytest.mark.parametrize("include", [False, True])
def test_delta_text_never_sends_text_a_stop_string_cuts(include: bool) -> None:
    """A stop string that straddles two steps' text (its first character from one token, the rest
    from the next): the deltas add up to the cut text, so none sent characters the cut removed."""
    steps = _run(_params())[0]
    whole = steps[-1].text
    stop = next(
        whole[b - 1 : b + 2]
        for b in (len(o.text) for o in steps[len(steps) // 3 :])
        if 0 < b < len(whole) - 2
        and whole.find(whole[b - 1 : b + 2]) == b - 1
        and "\ufffd" not in whole[b - 1 : b + 2]
    )
    kw = dict(stop=[stop], include_stop_str_in_output=include)
    cut = _run(_params(**kw))[0][-1]
    assert cut.finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert cut.text == whole[: whole.index(stop) + (len(stop) if include else 0)]
    deltas, _ = _run(_params(output_kind="delta", **kw))
    assert "".join(o.text for o in deltas) == cut.text
    assert [t for o in deltas for t in o.token_ids] == cut.token_ids


def test_final_only_returns_one_output_and_decodes_no_text_before_it() -> None:
    cumulative, _ = _run(_params(logprobs=1))
    final, _ = _run(_params(logprobs=1, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(final) == 1 and final[0].finished
    last = cumulative[-1]
    assert final[0].text == last.text
    assert final[0].token_ids == last.token_ids
    assert final[0].outputs[0].logprobs == last.outputs[0].logprobs
    assert final[0].finish_reason == last.finish_reason
    # no output before the last step, and (no stop strings, no logprobs to name) no text either:
    # one decode at the end
    plain, decoded = _run(_params(output_kind=RequestOutputKind.FINAL_ONLY))
    assert plain[0].text == last.text
    assert decoded[:-1] == [0] * (len(decoded) - 1) and decoded[-1] >= MAX_TOKENS


def test_final_only_with_stop_strings_still_stops_at_them() -> None:
    whole = _run(_params())[0][-1].text
    stop = next(
        whole[i : i + 2]
        for i in range(8, len(whole) - 2)
        if whole.find(whole[i : i + 2]) == i and whole[i].isalpha()
    )
    cut = _run(_params(stop=[stop]))[0][-1]
    final, _ = _run(_params(stop=[stop], output_kind="final_only"))
    assert len(final) == 1
    assert (final[0].text, final[0].token_ids, final[0].finish_reason) == (
        cut.text,
        cut.token_ids,
        "stop",
    )


def test_generate_asks_for_final_outputs_without_touching_the_callers_params() -> None:
    engine = _engine()
    params = _params()
    [out] = engine.generate([PROMPT], [params])
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    assert out.finished and out.text == _run(params)[0][-1].text


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("delta", RequestOutputKind.DELTA),
        ("FINAL_ONLY", RequestOutputKind.FINAL_ONLY),
        (0, RequestOutputKind.CUMULATIVE),
    ],
)
def test_output_kind_takes_a_kind_its_name_or_its_value(value: object, kind: RequestOutputKind) -> None:
    assert SamplingParams(output_kind=value).output_kind is kind  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["partial", 3, True, None, 1.0])
def test_an_unknown_output_kind_is_refused_with_the_choices(value: object) -> None:
    with pytest.raises(ConfigError, match=r"output_kind must be one of cumulative, delta, final_only"):
        SamplingParams(output_kind=value)  # type: ignore[arg-type]


def test_a_stream_reads_cumulative_text_whatever_the_output_kind() -> None:
    whole = _run(_params())[0][-1].text
    for kind in ("delta", "final_only"):
        assert "".join(_engine().stream(PROMPT, _params(output_kind=kind))) == whole, kind
