"""The server through the real ``openai`` client, against offline ``LLM`` on the same config.

One tiny-llama server (ngram:4, API key) is shared by the module; its start-up is held back at first
so the tests can see it answer 503 while starting.
"""

from __future__ import annotations

import threading
from functools import partial

import httpx
import openai
import pytest
from serve_fixtures import gated, metric, running

from warmcap.config import StartupOptions
from warmcap.graphs.proof.report import CaptureReport
from warmcap.llm import LLM, build_config
from warmcap.sampling_params import SamplingParams
from warmcap.serve import ServeOptions, build_app
from warmcap.serve.startup_facts import start_engine

MODEL = "tiny-llama"
API_KEY = "test-key"
K = 4
ENGINE_KW = {
    "num_blocks": 256,
    "max_model_len": 128,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "speculative_config": f"ngram:{K}",
    "device": "cpu",
}
PROMPTS = ["The capital of France is", "one two three one two three one two", "def add(a, b):\n    return"]


@pytest.fixture(scope="module")
def server():
    config = build_config(MODEL, **ENGINE_KW)
    start, gate = gated(partial(start_engine, config, StartupOptions(capture_sizes=(1, 2, 4, 8))))
    with running(build_app(config, ServeOptions(api_key=API_KEY), start=start), API_KEY) as srv:
        srv.before = {
            "health": httpx.get(srv.base_url + "/health"),
            "completion": httpx.post(
                srv.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=srv.headers()
            ),
            "metrics": srv.metrics(),
        }
        gate.set()
        srv.wait_ready()
        yield srv


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, enforce_eager=True, **ENGINE_KW)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def test_not_ready_until_startup_finishes(server) -> None:
    assert server.before["health"].status_code == 503
    early = server.before["completion"]
    assert early.status_code == 503
    assert "still starting" in early.json()["error"]["message"]
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_per_position_series_exist_from_startup(server) -> None:
    before = server.before["metrics"]
    for pos in range(K):
        assert metric(before, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == 0
    assert metric(before, "vllm:spec_decode_num_drafts_total") == 0


def test_completions_equal_offline_generate(server, offline) -> None:
    client = server.client()
    want = offline.generate(PROMPTS, _greedy(12))
    got = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [w.text for w in want]
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens

    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want[0].text
    assert chunks[-1].usage.completion_tokens == len(want[0].token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want[0].finish_reason


def test_token_id_prompt_equals_text_prompt(server, offline) -> None:
    ids = offline.engine.encode(PROMPTS[0])
    got = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert got.choices[0].text == offline.generate([ids], _greedy(8))[0].text


def test_chat_equals_offline_chat(server, offline) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    want = offline.chat(messages, _greedy(10))
    client = server.client()
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_32_concurrent_streams_batch_and_equal_sequential(server) -> None:
    client = server.client()
    prompts = [f"Request {i}: the number after {i} is" for i in range(32)]
    sequential = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0).choices[0].text
        for p in prompts
    ]
    results: list[str | None] = [None] * len(prompts)

    def one(i: int) -> None:
        stream = client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=10, temperature=0, stream=True
        )
        results[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert results == sequential
    assert metric(server.metrics(), "warmcap:max_num_requests_per_step") > 1
    assert server.all_blocks_free()
    after = server.metrics()
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0


def test_spec_counters_move_and_match_engine(server) -> None:
    client = server.client()
    before = metric(server.metrics(), "vllm:spec_decode_num_drafts_total")
    client.completions.create(model=MODEL, prompt=PROMPTS[1] * 3, max_tokens=24, temperature=0)
    m = server.metrics()
    drafts = metric(m, "vllm:spec_decode_num_drafts_total")
    accepted = metric(m, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > before
    assert metric(m, "vllm:spec_decode_num_draft_tokens_total") >= drafts
    engine = server.state.loop.engine
    assert 1 + accepted / drafts == pytest.approx(engine.spec_metrics.acceptance_length)
    per_pos = [
        metric(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(K)
    ]
    assert per_pos == engine.spec_metrics.accepted_per_pos
    assert metric(m, "vllm:prompt_tokens_total") > 0 and metric(m, "vllm:generation_tokens_total") > 0


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt": list(range(3, 203))}, "max_model_len"),
        ({"prompt": 42}, "prompt"),
        ({"prompt": [3, 10**9]}, "vocabulary"),
    ],
)
def test_bad_input_is_400_with_openai_error(server, body, needle) -> None:
    request = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **body}
    r = httpx.post(server.base_url + "/v1/completions", json=request, headers=server.headers())
    assert r.status_code == 400
    error = r.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error" and error["code"]
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(**request)


def test_wrong_or_missing_api_key_is_401(server) -> None:
    url = server.base_url + "/v1/completions"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {API_KEY}"}):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert httpx.get(server.base_url + "/health").status_code == 200  # health needs no key


def test_disconnect_mid_stream_aborts_and_frees_blocks(server) -> None:
    aborted = server.metrics().get(
        ("vllm:request_success_total", frozenset({("finished_reason", "abort")})), 0
    )
    body = {
        "model": MODEL,
        "prompt": "Tell a long story:",
        "max_tokens": 110,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=server.headers()) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
    assert server.all_blocks_free()
    assert metric(server.metrics(), "vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_models_version_and_startup_report(server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.base_url + "/version").json()["version"]
    report = CaptureReport.from_json(httpx.get(server.base_url + "/startup").text)
    assert report.model == MODEL and report.spec.k == K
    assert report.warmup_audit.violations == 0 and report.warmup_audit.slots_checked > 0
    m = server.metrics()
    assert metric(m, "warmcap:graphs_captured") == len(report.graphs) > 0
    assert metric(m, "warmcap:graphs_verified") == len(report.graphs)
    assert metric(m, "warmcap:warmup_audit_slots_checked") == report.warmup_audit.slots_checked
    assert metric(m, "warmcap:startup_phase_seconds", phase="warmup") > 0


def test_stop_string_ends_the_text(server) -> None:
    client = server.client()
    full = (
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop])
    assert got.choices[0].text == full[: full.index(stop)]
    assert got.choices[0].finish_reason == "stop"
