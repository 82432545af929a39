"""Every sampling parameter the server accepts, through the real ``openai`` client, against
``LLM.generate`` on the same prompts and engine config: the same choices, logprobs, penalised
text, echo, chat content parts and stop strings cut exactly in streams; what it cannot honour is
a 400 naming it; status codes and response fields as vLLM's server gives them."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_fixtures import TINY_ENGINE_KW, TINY_MODEL, running

from warmcap.llm import LLM, build_config
from warmcap.sampling_params import SamplingParams
from warmcap.serve import ServeOptions, build_app
from warmcap.serve.protocol import SYSTEM_FINGERPRINT

MODEL = TINY_MODEL
ENGINE_KW = TINY_ENGINE_KW
PROMPTS = ["The capital of France is", "one two three one two three one two"]
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def server():
    with running(build_app(build_config(MODEL, **ENGINE_KW), ServeOptions())) as srv:
        srv.wait_ready()
        yield srv


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, **ENGINE_KW)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def _post(server, path: str, **body: object) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=120)


def test_n_samples_equal_generate(client, offline) -> None:
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=8)
    want = offline.generate(PROMPTS, params)
    got = client.completions.create(model=MODEL, prompt=PROMPTS, n=3, temperature=0.9, seed=7, max_tokens=8)
    # Choice p * n + i is prompt p's i-th sample, as vLLM numbers them.
    assert [c.index for c in got.choices] == list(range(6))
    assert [c.text for c in got.choices] == [s.text for w in want for s in w.outputs]
    assert len({c.text for c in got.choices[:3]}) > 1  # the samples differ: n was not dropped
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert got.usage.completion_tokens == sum(len(s.token_ids) for w in want for s in w.outputs)

    messages = [{"role": "user", "content": "Name a colour."}]
    chat_want = offline.chat(messages, params)
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, n=3, temperature=0.9, seed=7, max_tokens=8
    )
    assert [c.message.content for c in chat.choices] == [s.text for s in chat_want.outputs]

    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], n=3, temperature=0.9, seed=7, max_tokens=8, stream=True
    )
    texts = [""] * 3
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [s.text for s in want[0].outputs]


def _assert_logprobs_equal(got_tokens, got_lps, got_tops, want, num_top: int) -> None:
    entries = want.outputs[0].logprobs
    assert len(got_lps) == len(want.token_ids) == len(entries)
    for tok, entry, text, lp, top in zip(want.token_ids, entries, got_tokens, got_lps, got_tops, strict=True):
        assert text == entry[tok].decoded_token
        assert lp == pytest.approx(entry[tok].logprob, abs=LOGPROB_TOL)
        best = sorted(entry.values(), key=lambda x: x.rank)[:num_top]
        assert [t for t, _ in top] == [b.decoded_token for b in best]
        assert [v for _, v in top] == pytest.approx([b.logprob for b in best], abs=LOGPROB_TOL)


def test_completion_logprobs_equal_generate(client, offline) -> None:
    want = offline.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, logprobs=2))[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    tops = [sorted(t.items(), key=lambda kv: -kv[1])[:2] for t in lp.top_logprobs]
    _assert_logprobs_equal(lp.tokens, lp.token_logprobs, tops, want, 2)
    assert "".join(lp.tokens) == got.choices[0].text == want.text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])

    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2, stream=True
    )
    streamed = [t for chunk in stream for c in chunk.choices if c.logprobs for t in c.logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=LOGPROB_TOL)


def test_chat_logprobs_equal_generate(client, offline) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    want = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3))
    got = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = got.choices[0].logprobs.content
    tops = [[(t.token, t.logprob) for t in c.top_logprobs] for c in content]
    _assert_logprobs_equal([c.token for c in content], [c.logprob for c in content], tops, want, 3)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    "penalty",
    [{"repetition_penalty": 1.8}, {"frequency_penalty": 1.5}, {"presence_penalty": 1.5}],
    ids=["repetition", "frequency", "presence"],
)
def test_penalties_equal_generate(client, offline, penalty) -> None:
    prompt = PROMPTS[1]
    plain = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24))[0]
    want = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, **penalty))[0]
    assert want.text != plain.text  # the penalty changes this prompt's greedy text
    got = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body=penalty
    )
    assert got.choices[0].text == want.text
    messages = [{"role": "user", "content": prompt}]
    chat_want = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=24, **penalty))
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, extra_body=penalty
    )
    assert chat.choices[0].message.content == chat_want.text


def test_echo_prepends_the_prompt(client, offline) -> None:
    want = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))
    got = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, echo=True)
    assert [c.text for c in got.choices] == [p + w.text for p, w in zip(PROMPTS, want, strict=True)]
    ids = offline.engine.encode(PROMPTS[0])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert by_ids.choices[0].text == offline.engine.decode(ids) + want[0].text
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == PROMPTS[0] + want[0].text


def test_chat_content_parts_equal_string_content(client, offline) -> None:
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "Be brief."}]
    want = offline.chat(
        [{"role": "user", "content": "Name a colour.\nBe brief."}],
        SamplingParams(temperature=0.0, max_tokens=8),
    )
    got = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=8, temperature=0
    )
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def _spanning_stop(offline: LLM, prompt: str, max_tokens: int) -> tuple[str, str]:
    """A stop string that straddles two tokens of ``prompt``'s greedy answer (first seen there),
    and the text before it."""
    out = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    text, decode = out.text, offline.engine.decode
    for j in range(2, len(out.token_ids) - 1):
        cut = len(decode(out.token_ids[:j]))
        stop = text[cut - 2 : cut + 2]
        if len(stop) == 4 and stop.strip() == stop and text.find(stop) == cut - 2:
            return stop, text[: cut - 2]
    raise AssertionError(f"no stop string straddles two tokens of {text!r}")


def test_stop_string_across_tokens_is_cut_exactly_in_streams(client, offline) -> None:
    stop, before = _spanning_stop(offline, PROMPTS[0], 24)
    want = offline.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))[0]
    assert want.text == before and want.outputs[0].stop_reason == stop
    plain = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop]
    )
    assert plain.choices[0].text == before and plain.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop], stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == before
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == stop

    messages = [{"role": "user", "content": "Tell me about France."}]
    chat_full = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=24))
    tokens, decode = chat_full.token_ids, offline.engine.decode
    cut = len(decode(tokens[: len(tokens) // 2]))
    chat_stop = chat_full.text[cut - 1 : cut + 2]
    chat_want = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=24, stop=[chat_stop]))
    chat_stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stop=[chat_stop], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices) == chat_want.text


def test_response_fields(client, offline) -> None:
    want = offline.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6))[0]
    got = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = got.choices[0]
    assert got.system_fingerprint == SYSTEM_FINGERPRINT
    assert choice.token_ids == want.token_ids and choice.prompt_token_ids == want.prompt_token_ids
    assert "stop_reason" in choice.model_extra and choice.stop_reason is None  # length, not a stop

    eos = want.token_ids[2]
    stopped = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body={"stop_token_ids": [eos]}
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].stop_reason == eos

    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    chunks = [c for c in stream if c.choices]
    assert [t for c in chunks for t in c.choices[0].token_ids] == want.token_ids
    assert chunks[0].choices[0].prompt_token_ids == want.prompt_token_ids
    assert all(c.system_fingerprint == SYSTEM_FINGERPRINT for c in chunks)

    messages = [{"role": "user", "content": "hi"}]
    chat_want = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=4))
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
    )
    assert chat.system_fingerprint == SYSTEM_FINGERPRINT
    assert chat.prompt_token_ids == chat_want.prompt_token_ids
    assert chat.choices[0].token_ids == chat_want.token_ids
    assert "stop_reason" in chat.choices[0].model_extra


@pytest.mark.parametrize(
    ("path", "body", "status", "error", "needle"),
    [
        ("/v1/completions", {"model": "gpt-4"}, 404, openai.NotFoundError, "gpt-4"),
        ("/v1/chat/completions", {"model": "gpt-4"}, 404, openai.NotFoundError, "gpt-4"),
        ("/v1/completions", {"n": 0}, 400, openai.BadRequestError, "n must be"),
        ("/v1/completions", {"logprobs": -1}, 400, openai.BadRequestError, "logprobs"),
        (
            "/v1/completions",
            {"max_tokens": 10**9},
            400,
            openai.BadRequestError,
            "max_tokens 1000000000 is too large",
        ),
        ("/v1/chat/completions", {"max_tokens": 10**9}, 400, openai.BadRequestError, "context is 256 tokens"),
        ("/v1/completions", {"prompt": ""}, 400, openai.BadRequestError, "empty prompt"),
        ("/v1/completions", {"prompt": [[]]}, 400, openai.BadRequestError, "empty prompt"),
        ("/v1/completions", {"prompt": []}, 400, openai.BadRequestError, "empty prompt"),
        ("/v1/completions", {"prompt": list(range(3, 300))}, 400, openai.BadRequestError, "max_model_len"),
        ("/v1/completions", {"temperature": -0.5}, 400, openai.BadRequestError, "temperature"),
        ("/v1/completions", {"repetition_penalty": 0}, 400, openai.BadRequestError, "repetition_penalty"),
        ("/v1/completions", {"logit_bias": {"5": 1}}, 400, openai.BadRequestError, "logit_bias"),
        ("/v1/completions", {"suffix": "end"}, 400, openai.BadRequestError, "suffix"),
        ("/v1/completions", {"max_tokens": 0}, 400, openai.BadRequestError, "only with echo=true"),
        ("/v1/completions", {"prompt_logprobs": 21}, 400, openai.BadRequestError, "prompt_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, 400, openai.BadRequestError, "logprobs=true"),
        (
            "/v1/chat/completions",
            {"logprobs": True, "top_logprobs": 21},
            400,
            openai.BadRequestError,
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, 400, openai.BadRequestError, "tools"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            openai.BadRequestError,
            "image_url",
        ),
    ],
)
def test_status_codes_like_vllm(server, path, body, status, error, needle) -> None:
    request = {"model": MODEL, "max_tokens": 4, **body}
    if path == "/v1/completions":
        request.setdefault("prompt", "hello")
    else:
        request.setdefault("messages", [{"role": "user", "content": "hello"}])
    r = httpx.post(server.base_url + path, json=request, timeout=60)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert needle in message, message
    assert "num_external_computed_tokens" not in message  # no internal invariant leaks
    client = server.client()
    call = client.completions.create if path == "/v1/completions" else client.chat.completions.create
    model = request.pop("model")
    named = {k: request.pop(k) for k in ("prompt", "messages", "max_tokens") if k in request}
    with pytest.raises(error):
        call(model=model, **named, extra_body=request)


def test_null_fields_and_user_are_accepted(server) -> None:
    r = _post(server, "/v1/completions", prompt="hello", max_tokens=2, logit_bias=None, user="someone")
    assert r.status_code == 200, r.text
