"""Output processing: the text of a step's outputs grows by the new tokens only, and stop strings are
cut where decoding the whole output token by token (the old search, the oracle here) cuts them."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from warmcap.detokenizer import MAX_PENDING, TextDecoder
from warmcap.engine import LLMEngine
from warmcap.models.loader import load_tokenizer
from warmcap.models.presets import resolve_model
from warmcap.output_processor import find_stop_string
from warmcap.outputs import StopHit
from warmcap.sampling_params import SamplingParams

MAX_MODEL_LEN = 256
BATCH = 4


def test_a_steps_detokenisation_work_does_not_grow_with_the_output_length() -> None:
    """Requests generate to the model's length limit; the token ids decoded in a step stay bounded
    by a window per request (decoding the whole outputs would pass ~1,000 ids a step by the end),
    and the texts are the tokenizer's decode of the whole outputs."""
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=BATCH * MAX_MODEL_LEN // 16 + 1),
        scheduler=SchedulerConfig(max_num_seqs=BATCH, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN),
    )
    engine = LLMEngine(config, startup_hooks=[])
    prompts = [[5 + i, 17, 99, 230] for i in range(BATCH)]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_MODEL_LEN - 4, ignore_eos=True)
    req_ids = [engine.add_request(p, params) for p in prompts]
    per_step: list[int] = []
    done = {}
    while engine.has_unfinished():
        before = engine.detokenizer.tokens_decoded
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        per_step.append(engine.detokenizer.tokens_decoded - before)
    outs = [done[r] for r in req_ids]
    assert all(len(o.token_ids) == MAX_MODEL_LEN - 4 for o in outs)
    for o in outs:
        assert o.text == engine.tokenizer.decode(o.token_ids, skip_special_tokens=True)
    # one token a request a step: its window is that token and the ids of an incomplete character
    assert max(per_step) <= BATCH * (MAX_PENDING + 4), per_step
    quarter = len(per_step) // 4
    early, late = per_step[1:quarter], per_step[-quarter:]
    assert sum(late) / len(late) <= 1.5 * sum(early) / len(early), (early, late)


@functools.cache
def _tokenizer() -> Any:
    return load_tokenizer(resolve_model("tiny-llama"))


def _whole_decode_search(
    decode: Any, ids: Sequence[int], stops: Sequence[str], min_tokens: int, include: bool
) -> StopHit | None:
    """The search as it was, decoding the first ``count`` ids whole for every count (less a bug:
    a character the previous text held as U+FFFD is searched again once complete)."""
    longest = max(map(len, stops))
    previous = decode(ids[: max(min_tokens, 1) - 1])
    for count in range(max(min_tokens, 1), len(ids) + 1):
        text = decode(ids[:count])
        start = max(0, len(previous.rstrip("\ufffd")) - longest + 1)
        hits = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
        if hits:
            at, stop = min(hits)
            return StopHit(count, text[: at + len(stop) if include else at], stop)
        previous = text
    return None


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_stop_strings_are_found_where_the_whole_decode_finds_them(data: st.DataObject) -> None:
    tok = _tokenizer()
    text = data.draw(st.text(alphabet="ab é€😀\n<|", min_size=1, max_size=30))
    ids = tok.encode(text, add_special_tokens=False) + data.draw(st.lists(st.integers(0, 511), max_size=4))
    decoder = TextDecoder(tok)
    whole = decoder(ids)
    stops = data.draw(
        st.lists(
            st.one_of(
                st.integers(0, max(0, len(whole) - 1)).flatmap(
                    lambda i: st.integers(i + 1, i + 4).map(lambda j: whole[i:j] or "x")
                ),
                st.text(alphabet="ab é€😀", min_size=1, max_size=3),
            ),
            min_size=1,
            max_size=3,
        )
    )
    min_tokens = data.draw(st.integers(0, len(ids) + 1))
    include = data.draw(st.booleans())
    want = _whole_decode_search(decoder, ids, stops, min_tokens, include)
    # the engine searches each step's new tokens: a few at a time
    stream = decoder.stream()
    hit = None
    end = 0
    while hit is None and end < len(ids):
        end = min(len(ids), end + data.draw(st.integers(1, 3)))
        hit = find_stop_string(stream, ids[:end], stops, min_tokens=min_tokens, include_stop=include)
    assert hit == want


def test_a_stream_sends_the_text_before_a_stop_string_exactly() -> None:
    """Stop strings around multi-byte characters that tokens split: the engine's stream sends
    exactly the text before the first occurrence in the whole output's decode (or with it)."""
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=32),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128),
    )
    engine = LLMEngine(config, startup_hooks=[])

    def case(seed: int) -> tuple[str, list[str]] | None:
        """The seed's whole text and three stops in it (a multi-byte character, one with the
        character before it, three characters mid-text), or None when a stop would hold U+FFFD."""
        sampled = SamplingParams(temperature=1.0, seed=seed, max_tokens=60, ignore_eos=True)
        [ref] = engine.generate(["x"], [sampled])
        whole = engine.tokenizer.decode(ref.token_ids, skip_special_tokens=True)
        wide = [i for i, c in enumerate(whole) if ord(c) > 127 and c != "\ufffd"]
        if not wide:
            return None
        mid = len(whole) // 2
        stops = [whole[wide[0]], whole[wide[-1] - 1 : wide[-1] + 1], whole[mid : mid + 3]]
        return None if any("\ufffd" in stop for stop in stops) else (whole, stops)

    # the first seed whose random text holds such stops (the seeded random model writes
    # multi-byte characters, and sometimes a token that leaves one unfinished)
    seed, (whole, stops) = next((s, c) for s in range(3, 60) if (c := case(s)) is not None)
    for stop, include in zip(stops, [False, True, False], strict=True):
        params = SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=60,
            ignore_eos=True,
            stop=(stop,),
            include_stop_str_in_output=include,
        )
        streamed = "".join(engine.stream("x", params))
        [out] = engine.generate(["x"], [params])
        end = whole.index(stop) + (len(stop) if include else 0)
        assert streamed == out.text == whole[:end], stop
        assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
