"""Prompt logprobs over HTTP, field by field in vLLM's response shape, against ``LLM.generate`` with
``prompt_logprobs`` on the same engine config: ``/v1/completions`` with ``echo`` and ``logprobs``
(the prompt's tokens first, the first one's logprob null), ``echo`` with ``max_tokens: 0`` (just the
prompt: what lm-eval's loglikelihood requests send), streamed and not, and the ``prompt_logprobs``
field of completions and chat."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serve_fixtures import running

from warmcap.llm import LLM, build_config
from warmcap.sampling_params import SamplingParams
from warmcap.serve import ServeOptions, build_app

MODEL = "tiny-llama"
ENGINE_KW = {
    "num_blocks": 64,
    "max_model_len": 128,
    "max_num_seqs": 4,
    "device": "cpu",
    "enforce_eager": True,
}
PROMPT = "The capital of France is Paris, and the capital of Italy is"
TOL = 1e-4
#: vLLM's ``CompletionResponseChoice`` and ``CompletionLogProbs`` fields (vllm/entrypoints/openai/protocol.py)
CHOICE_KEYS = {
    "index",
    "text",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "prompt_logprobs",
    "prompt_token_ids",
    "token_ids",
}
LOGPROBS_KEYS = {"text_offset", "token_logprobs", "tokens", "top_logprobs"}


@pytest.fixture(scope="module")
def server():
    with running(build_app(build_config(MODEL, **ENGINE_KW), ServeOptions())) as srv:
        srv.wait_ready()
        yield srv


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, **ENGINE_KW)


def _post(server, path: str, **body: object) -> dict:
    r = httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _want(offline: LLM, max_tokens: int, k: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=k, prompt_logprobs=k)
    return offline.generate(PROMPT, params)[0]


def _assert_top(top: dict[str, float], entry, k: int) -> None:
    """The entry's token first then its k most likely, by text, as vLLM lists them."""
    want = list(entry.values())[: k + 1]
    assert top == pytest.approx({lp.decoded_token: lp.logprob for lp in want}, abs=TOL)


def test_echo_with_logprobs_lists_the_prompt_then_the_completion(server, offline) -> None:
    k = 2
    want = _want(offline, 3, k)
    body = _post(server, "/v1/completions", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=k, echo=True)
    [choice] = body["choices"]
    assert set(choice) == CHOICE_KEYS
    assert choice["text"] == PROMPT + want.text
    lp = choice["logprobs"]
    assert set(lp) == LOGPROBS_KEYS
    ids = want.prompt_token_ids + want.token_ids
    entries = want.prompt_logprobs + want.outputs[0].logprobs
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    # The prompt's first token: its text, nothing to condition on.
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][0] == offline.engine.decode(ids[:1])
    for i in range(1, len(ids)):
        entry = entries[i]
        assert lp["tokens"][i] == entry[ids[i]].decoded_token
        assert lp["token_logprobs"][i] == pytest.approx(entry[ids[i]].logprob, abs=TOL)
        _assert_top(lp["top_logprobs"][i], entry, k)
    # Offsets run over the listed tokens' texts from the start of the echoed prompt.
    assert lp["text_offset"][0] == 0
    for i in range(1, len(ids)):
        assert lp["text_offset"][i] == lp["text_offset"][i - 1] + len(lp["tokens"][i - 1])
    # vLLM's prompt_logprobs field: null first, then {token_id: {logprob, rank, decoded_token}}.
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(want.prompt_token_ids) and plp[0] is None
    for pos in range(1, len(plp)):
        entry = want.prompt_logprobs[pos]
        assert list(plp[pos]) == [str(t) for t in entry]
        for t, lp_ in entry.items():
            got = plp[pos][str(t)]
            assert set(got) == {"logprob", "rank", "decoded_token"}
            assert got["rank"] == lp_.rank and got["decoded_token"] == lp_.decoded_token
            assert got["logprob"] == pytest.approx(lp_.logprob, abs=TOL)
    assert body["usage"] == {
        "prompt_tokens": len(want.prompt_token_ids),
        "completion_tokens": 3,
        "total_tokens": len(ids),
    }

    # Streamed: the first chunk carries the prompt, the chunks join to the same lists.
    stream = httpx.post(
        server.base_url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": k,
            "echo": True,
            "stream": True,
        },
        timeout=120,
    )
    chunks = [c for c in _events(stream.text) if c["choices"]]
    joined = {key: [v for c in chunks for v in c["choices"][0]["logprobs"][key]] for key in LOGPROBS_KEYS}
    assert joined["tokens"] == lp["tokens"] and joined["text_offset"] == lp["text_offset"]
    assert joined["token_logprobs"][0] is None
    assert joined["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=TOL)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


def test_echo_with_max_tokens_0_returns_just_the_prompt(server, offline) -> None:
    want = _want(offline, 1, 1)
    client = server.client()
    got = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    [choice] = got.choices
    assert choice.text == PROMPT
    lp = choice.logprobs
    assert len(lp.tokens) == len(want.prompt_token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(
        [want.prompt_logprobs[i][t].logprob for i, t in enumerate(want.prompt_token_ids) if i], abs=TOL
    )
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.usage.completion_tokens == 0

    # Token-id prompts, as lm-eval sends them (several per request): each choice its own prompt.
    ids = offline.engine.encode(PROMPT)
    batch = client.completions.create(model=MODEL, prompt=[ids, ids[:5]], max_tokens=0, echo=True, logprobs=1)
    assert [len(c.logprobs.tokens) for c in batch.choices] == [len(ids), 5]
    assert batch.choices[1].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:5], abs=TOL)

    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, stream=True
    )
    chunks = [c for c in stream if c.choices]
    assert len(chunks) == 1 and chunks[0].choices[0].text == PROMPT
    assert chunks[0].choices[0].logprobs.tokens == lp.tokens

    # Without echo there is nothing to return: a 400 saying what to do.
    with pytest.raises(openai.BadRequestError, match="only with echo=true"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    # A P/D consumer loads the prompt's KV instead of computing it: no prompt logprobs to give.
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 0,
            "echo": True,
            "logprobs": 1,
            "kv_transfer_params": {"do_remote_prefill": True},
        },
        timeout=60,
    )
    assert r.status_code == 400 and "kv_transfer_params" in r.json()["error"]["message"]


def test_chat_prompt_logprobs_field(server, offline) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    body = _post(
        server, "/v1/chat/completions", messages=messages, max_tokens=2, temperature=0, prompt_logprobs=1
    )
    plp = body["prompt_logprobs"]
    assert len(plp) == len(want.prompt_token_ids) and plp[0] is None
    for pos in range(1, len(plp)):
        entry = want.prompt_logprobs[pos]
        assert list(plp[pos]) == [str(t) for t in entry]
        assert [v["logprob"] for v in plp[pos].values()] == pytest.approx(
            [lp.logprob for lp in entry.values()], abs=TOL
        )
    plain = _post(server, "/v1/chat/completions", messages=messages, max_tokens=2, temperature=0)
    assert plain["prompt_logprobs"] is None


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
