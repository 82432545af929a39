"""What a client going away and a failing step do to the requests in flight: a disconnect aborts
every engine request behind it (streamed or not, queued or running) before the next step, with its
blocks freed; a failed step ends only the requests it ran."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_fixtures import TINY_ENGINE_KW, TINY_MODEL, metric, running

from warmcap.llm import build_config
from warmcap.serve import ServeOptions, build_app

MODEL = TINY_MODEL
ENGINE_KW = TINY_ENGINE_KW


@pytest.fixture(scope="module")
def server():
    with running(build_app(build_config(MODEL, **ENGINE_KW), ServeOptions())) as srv:
        srv.wait_ready()
        yield srv


def _post(server, path: str, **body: object) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=120)


def _aborted(server) -> float:
    return server.metrics().get(("vllm:request_success_total", frozenset({("finished_reason", "abort")})), 0)


def _freed_within(server, seconds: float) -> float:
    """Seconds until nothing runs and no KV block is held (fails past ``seconds``)."""
    start = time.monotonic()
    while True:
        m = server.metrics()
        if metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:kv_cache_usage_perc") == 0:
            return time.monotonic() - start
        assert time.monotonic() - start < seconds, m
        time.sleep(0.01)


def test_disconnected_streams_abort_within_a_step(server) -> None:
    aborted = _aborted(server)
    body = {"model": MODEL, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}

    def first_chunk_then_close(i: int) -> str:
        with httpx.stream(
            "POST", server.base_url + "/v1/completions", json={**body, "prompt": f"Story {i}:"}
        ) as r:
            return next(line for line in r.iter_lines() if line)

    # 12 streams, 8 running at a time: the last 4 wait in the queue until the first ones go.
    with ThreadPoolExecutor(12) as pool:
        firsts = list(pool.map(first_chunk_then_close, range(12)))
    assert all(f.startswith("data: {") for f in firsts)
    _freed_within(server, 1.0)
    assert _aborted(server) == aborted + 12
    assert server.all_blocks_free(timeout=1.0)


def test_queued_requests_whose_clients_left_never_run(server, monkeypatch) -> None:
    engine = server.state.loop.engine
    step = engine.step

    def slow_step():  # a slower model: the running streams outlast the queued clients' patience
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    aborted = _aborted(server)
    prompted = server.metrics().get(("vllm:prompt_tokens_total", frozenset()), 0)
    body = {"model": MODEL, "max_tokens": 240, "temperature": 0, "stream": True, "ignore_eos": True}
    url = server.base_url + "/v1/completions"
    with contextlib.ExitStack() as held:
        # 8 streams fill the running batch (max_num_seqs 8) and stay open.
        # NOTE: the line iterators are kept: dropping one closes its connection.
        lines = [
            held.enter_context(httpx.stream("POST", url, json={**body, "prompt": f"Run {i}:"})).iter_lines()
            for i in range(8)
        ]
        for it in lines:
            assert next(line for line in it if line).startswith("data: {")
        running = metric(server.metrics(), "vllm:prompt_tokens_total")
        # 4 more wait in the queue; their clients give up before a first chunk.
        for i in range(4):
            with (
                pytest.raises(httpx.ReadTimeout),
                httpx.stream(
                    "POST", url, json={**body, "prompt": f"Wait {i}:"}, timeout=httpx.Timeout(60, read=0.3)
                ),
            ):
                pass
        start = time.monotonic()
        while _aborted(server) < aborted + 4 or metric(server.metrics(), "vllm:num_requests_waiting"):
            assert time.monotonic() - start < 1.0
            time.sleep(0.01)
        assert metric(server.metrics(), "vllm:num_requests_running") == 8
    _freed_within(server, 1.0)
    assert _aborted(server) == aborted + 12
    # The queued ones never ran: no prompt token of theirs was computed.
    assert metric(server.metrics(), "vllm:prompt_tokens_total") == running > prompted


def test_a_closed_plain_request_stops_generating(server) -> None:
    aborted = _aborted(server)
    generated = metric(server.metrics(), "vllm:generation_tokens_total")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    _freed_within(server, 1.0)
    assert _aborted(server) == aborted + 1
    after = metric(server.metrics(), "vllm:generation_tokens_total")
    time.sleep(0.3)
    assert metric(server.metrics(), "vllm:generation_tokens_total") == after  # nothing runs on
    assert after - generated < 240


def test_a_failed_step_ends_its_own_requests_only(server, monkeypatch) -> None:
    """A step that fails (here: a forward raising) ends the requests it ran with a 500; a request
    waiting in the queue meanwhile runs afterwards and completes with its own text."""
    engine = server.state.loop.engine
    step, execute = engine.step, engine.runner.execute_model_result
    armed = threading.Event()

    def slow_step():  # a slower model: the running streams are still running when the step fails
        time.sleep(0.02)
        return step()

    def failing_execute(sched_out):
        if armed.is_set() and engine.scheduler.waiting:
            armed.clear()
            raise RuntimeError("injected forward failure")
        return execute(sched_out)

    monkeypatch.setattr(engine, "step", slow_step)
    monkeypatch.setattr(engine.runner, "execute_model_result", failing_execute)
    body = {"model": MODEL, "max_tokens": 240, "temperature": 0, "stream": True, "ignore_eos": True}
    url = server.base_url + "/v1/completions"
    alone = _post(server, "/v1/completions", prompt="The capital of France is", max_tokens=8, temperature=0)
    with contextlib.ExitStack() as held, ThreadPoolExecutor(1) as pool:
        streams = [
            held.enter_context(httpx.stream("POST", url, json={**body, "prompt": f"Run {i}:"})).iter_lines()
            for i in range(8)
        ]
        for it in streams:
            assert next(line for line in it if line).startswith("data: {")
        queued = pool.submit(
            _post, server, "/v1/completions", prompt="The capital of France is", max_tokens=8, temperature=0
        )
        start = time.monotonic()
        while metric(server.metrics(), "vllm:num_requests_waiting") < 1:
            assert time.monotonic() - start < 30
            time.sleep(0.01)
        armed.set()
        answer = queued.result(timeout=60)
        for it in streams:
            events = [line for line in it if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert "injected forward failure" in json.loads(events[-2][len("data: ") :])["error"]["message"]
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    _freed_within(server, 1.0)
