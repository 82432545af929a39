"""Async scheduling (one step in flight): the engine schedules and launches step N+1 before it reads
step N's tokens. The oracle is the synchronous engine on the same weights: greedy tokens identical
with and without it (SmolLM2, with and without speculation, the KV-write audit on), through
preemption, requests joining late, aborts and stop strings; ``max_tokens`` never costs a step and
a stop token at most one discarded token."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.engine import LLMEngine
from warmcap.errors import ConfigError
from warmcap.llm import LLM
from warmcap.sampling_params import SamplingParams

SMOL_PROMPTS = [
    "The capital of France is",
    "Repeat after me: red green blue, red green blue, red green blue, red green",
    "Write one sentence about the sea.",
    "def add(a, b):",
]
# Some stop at EOS (the third, at once), the rest at max_tokens.
SMOL_PARAMS = [SamplingParams(temperature=0.0, max_tokens=m) for m in (24, 30, 17, 40)]


def _smol(async_scheduling: bool, spec: str | None, *, eager: bool) -> LLM:
    return LLM(
        "smollm2-135m",
        device="cpu",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        num_blocks=96,
        enforce_eager=eager,
        speculative_config=spec,
        async_scheduling=async_scheduling,
        audit_serving=True,
    )


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize(
    ("spec", "eager"),
    [(None, False), ("ngram:4", True), ("draft_model:2@self", True)],
    ids=["none", "ngram4", "draft2"],
)
def test_smollm2_greedy_tokens_are_the_same_with_async_scheduling(spec: str | None, eager: bool) -> None:
    want = [o.outputs[0] for o in _smol(False, spec, eager=eager).generate(SMOL_PROMPTS, SMOL_PARAMS)]
    llm = _smol(True, spec, eager=eager)
    engine = llm.engine
    assert engine.config.scheduler.async_scheduling
    if not eager:
        # Start-up is untouched: every graph captured and proven against eager before serving.
        checks = engine.graph_startup.checks
        assert checks and all(c.verified for c in checks), [c for c in checks if not c.verified]
    got = [o.outputs[0] for o in llm.generate(SMOL_PROMPTS, SMOL_PARAMS)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    # Every serving step was audited (audit_serving): no write outside a request's blocks.
    assert engine.serving_audit is not None and engine.serving_audit.totals.slots_checked > 0
    if spec is not None:
        # The drafter's real proposals were verified (not the scheduler's placeholders).
        metrics = engine.spec_metrics
        assert metrics.num_drafts > 0
        if spec.startswith("draft_model"):
            assert metrics.acceptance_length == 3.0
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.num_blocks - 1


def _engine(
    async_scheduling: bool, *, num_blocks: int = 64, spec: str | None = None, model: str = "tiny-llama"
) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=model, device="cpu", enforce_eager=True),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=24, max_model_len=128, async_scheduling=async_scheduling
        ),
        speculative=SpeculativeConfig.parse(spec),
    )
    return LLMEngine(config, startup_hooks=[])


def _prompts(n: int = 5) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 500) for _ in range(length)] for length in (5, 16, 17, 33, 40)[:n]]


def _staggered(engine: LLMEngine, *, abort_at: int | None = None) -> dict[int, list[int]]:
    """Two requests, three more after three steps; with ``abort_at``, request 1 is aborted at that
    step (while a step runs with it). Returns each request's tokens."""
    prompts = _prompts()
    ids: dict[str, int] = {}
    tokens: dict[int, list[int]] = {}

    def add(i: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=24 if i % 2 == 0 else 11 + i, ignore_eos=True)
        ids[engine.add_request(prompts[i], params)] = i

    add(0)
    add(1)
    steps = 0
    while engine.has_unfinished():
        if steps == 3:
            for i in range(2, len(prompts)):
                add(i)
        if steps == abort_at:
            assert engine.abort(next(r for r, i in ids.items() if i == 1))
        for out in engine.step():
            tokens[ids[out.request_id]] = out.token_ids
        steps += 1
    return tokens


@pytest.mark.parametrize("spec", [None, "ngram:2"], ids=["plain", "ngram2"])
def test_preemption_and_late_joins_give_the_synchronous_tokens(spec: str | None) -> None:
    want = _staggered(_engine(False, spec=spec))
    # 10 usable blocks cannot hold five requests of up to 64 tokens at once: requests are preempted
    # while a step with them is in flight.
    tight = _engine(True, num_blocks=11, spec=spec)
    got = _staggered(tight)
    assert tight.scheduler.num_preemptions > 0
    assert got == want
    assert tight.kv_cache_manager.pool.num_free_blocks == tight.num_blocks - 1
    tight.step()  # delivers the last finished ids to the runner
    assert tight.runner.batch.num_reqs == 0


def test_an_abort_while_its_step_is_in_flight_ends_it_alone() -> None:
    want = _staggered(_engine(False))
    engine = _engine(True)
    got = _staggered(engine, abort_at=5)
    assert {i: t for i, t in got.items() if i != 1} == {i: t for i, t in want.items() if i != 1}
    # The aborted request returned only tokens it really had (a prefix of its synchronous output).
    assert 0 < len(got[1]) < len(want[1]) and got[1] == want[1][: len(got[1])]
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.num_blocks - 1
    engine.step()
    assert engine.runner.batch.num_reqs == 0


def _sampling_steps(engine: LLMEngine) -> Counter[str]:
    """Counts, per request, the steps the runner ran in which it sampled a token."""
    counts: Counter[str] = Counter()
    run = engine.runner.execute_model_async

    def counted(sched_out):
        record = run(sched_out)
        step = record.step
        if step is not None:
            counts.update(r for r, n in zip(step.req_ids, step.num_logits.tolist(), strict=True) if n)
        return record

    engine.runner.execute_model_async = counted
    return counts


def test_max_tokens_costs_no_step_and_a_stop_token_at_most_one() -> None:
    prompts = _prompts(3)
    sync = _engine(False)
    free_run = sync.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 3)
    # A stop token the first request meets mid-way (its 10th output).
    stop = free_run[0].token_ids[9]
    engine = _engine(True)
    steps = _sampling_steps(engine)
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    ]
    outs = engine.generate(prompts, params)
    want = sync.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    first = free_run[0].token_ids.index(stop) + 1
    assert len(outs[0].token_ids) == first and outs[0].finish_reason == "stop"
    assert [len(o.token_ids) for o in outs[1:]] == [7, 1]
    by_request = [steps[o.request_id] for o in outs]
    # max_tokens: one sampling step per token, none wasted; the stop token: at most one more.
    assert by_request[1:] == [7, 1]
    assert first <= by_request[0] <= first + 1


def test_stop_strings_are_cut_exactly_in_streams_and_outputs() -> None:
    sync, engine = _engine(False), _engine(True)
    prompt = _prompts(1)[0]
    free = sync.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)])[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    assert stop.strip(), f"no printable stop string in {free.text!r}"
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])
    want = sync.generate([prompt], [params])[0]
    got = engine.generate([prompt], [params])[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert stop not in got.text and got.finish_reason == "stop"
    assert "".join(engine.stream(prompt, params)) == "".join(sync.stream(prompt, params)) == want.text
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.num_blocks - 1


def test_async_scheduling_is_off_on_cpu_unless_asked_and_refused_where_unsupported() -> None:
    # Auto: nothing overlaps a CPU forward, so the engine schedules synchronously.
    assert _engine_auto().config.scheduler.async_scheduling is False
    with pytest.raises(ConfigError, match="async_scheduling is not supported with tensor_parallel_size = 2"):
        EngineConfig(scheduler=SchedulerConfig(async_scheduling=True), tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="async_scheduling is not supported with kv_role 'consumer'"):
        EngineConfig(scheduler=SchedulerConfig(async_scheduling=True), kv_role="consumer")
    with pytest.raises(ConfigError, match="Mamba state"):
        _engine(True, model="tiny-hybrid")


def _engine_auto() -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu", enforce_eager=True),
        cache=CacheConfig(block_size=16, num_blocks=16),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64),
    )
    return LLMEngine(config, startup_hooks=[])


def test_decode_steps_take_the_previous_tokens_on_the_device_unread() -> None:
    """Without drafts, step N+1 runs before step N's tokens are read: its input ids come from step
    N's samples on the device (the host holds placeholders until the read)."""
    engine = _engine(True)
    runner = engine.runner
    unread_at_forward: list[bool] = []
    forward = runner.forward_batch

    def watched(num_tokens, metas):
        unread_at_forward.append(any(r.pending for r in runner._pending))
        return forward(num_tokens, metas)

    runner.forward_batch = watched
    prompts = _prompts(3)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 9, 14)]
    # A seeded random request takes the same path (its token is whatever the sampler drew).
    params[2] = SamplingParams(temperature=0.9, seed=11, max_tokens=14, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in _engine(False).generate(prompts, params)]
    # Every decode step after the first ran with the previous step's tokens still unread.
    assert sum(unread_at_forward) >= 15
    # Once read, the host batch holds the real tokens in the placeholders' places (the longest
    # request still has its row: its end reaches the runner with the next step).
    batch = runner.batch
    row = batch.row_of[outs[0].request_id]
    assert batch.token_ids[row, : batch.num_tokens[row]].tolist() == prompts[0] + outs[0].token_ids


def test_logprobs_prompt_logprobs_penalties_and_min_tokens_are_the_synchronous_ones() -> None:
    """Each step's logits and prompt logprobs travel with its result, read a step late; rows whose
    logits are shaped (penalties, min_tokens) read the tokens in flight before the next step."""
    prompts = _prompts(3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=9, min_tokens=6, presence_penalty=0.5),
    ]
    want = _engine(False).generate(prompts, params)
    got = _engine(True).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert got[0].outputs[0].logprobs == want[0].outputs[0].logprobs and len(got[0].outputs[0].logprobs) == 12
    assert got[0].prompt_logprobs == want[0].prompt_logprobs and got[0].prompt_logprobs[1] is not None
