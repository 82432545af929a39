"""The warmup planner builds its steps with the scheduler's own rules (core/step_builder.py).

The scheduler serves a random request stream; each of its steps is rebuilt by the planner's
simulator from the same requests (the ones the scheduler picked, in its order, with the drafts it
verified) and must come out record for record the same. A check that only one of them makes —
a length cap, a budget, a sequence limit, another lookahead — makes one refuse or cut a step the
other builds, and the records differ.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from warmcap.core.kv_cache_manager import KVCacheManager
from warmcap.core.kv_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from warmcap.core.outputs import ModelRunnerOutput, SchedulerOutput
from warmcap.core.request import Request
from warmcap.core.scheduler import Scheduler
from warmcap.core.step_rules import step_lookahead
from warmcap.errors import CapacityError
from warmcap.sampling_params import SamplingParams
from warmcap.warmup.planner import _DoesNotFit, _Entry, _Simulator


def _config(
    *, k: int, block_size: int, max_model_len: int, seqs: int, budget: int, chunked: bool
) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(block_size=block_size, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_seqs=seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
        ),
        speculative=SpeculativeConfig.parse(f"eagle:{k}" if k else None),
    )


def _records(out: SchedulerOutput) -> dict:
    """What the runner reads from a step (draft token ids aside: the planner's are dummies)."""
    return {
        "new": [
            (n.req_id, list(n.prompt_token_ids), n.block_ids, n.num_computed_tokens, n.output_token_ids)
            for n in out.scheduled_new_reqs
        ],
        "cached": [
            (c.req_id, dict(c.new_block_ids), c.num_computed_tokens) for c in out.scheduled_cached_reqs
        ],
        "tokens": out.num_scheduled_tokens,
        "lookahead": out.num_lookahead_tokens,
        "drafts": {r: len(d) for r, d in out.scheduled_spec_decode_tokens.items()},
    }


@st.composite
def streams(draw):
    k = draw(st.integers(0, 3))
    block_size = draw(st.sampled_from([2, 4, 8]))
    max_model_len = draw(st.integers(8, 48))
    budget = draw(st.integers(4, 32))
    chunked = draw(st.booleans())
    cfg = _config(
        k=k,
        block_size=block_size,
        max_model_len=max_model_len,
        seqs=draw(st.integers(1, 4)),
        budget=budget,
        chunked=chunked,
    )
    longest = max_model_len - 1 if chunked else min(max_model_len - 1, budget)
    # Long max_tokens run requests into max_model_len, where the length cap cuts their drafts.
    reqs = draw(
        st.lists(
            st.tuples(st.integers(1, longest), st.integers(1, 2 * max_model_len)), min_size=1, max_size=6
        )
    )
    groups = [KVCacheGroup("full", FullAttentionSpec(block_size=block_size))]
    if draw(st.booleans()):
        window = draw(st.integers(2, 16))
        groups.append(KVCacheGroup("swa", SlidingWindowSpec(block_size, 1, 8, sliding_window=window)))
    num_blocks = draw(st.integers(8, 120))
    return cfg, groups, num_blocks, reqs, draw(st.integers(0, 2**16))


@settings(max_examples=150, deadline=None)
@given(streams())
def test_planner_rebuilds_every_scheduler_step_exactly(case):
    cfg, groups, num_blocks, reqs, seed = case
    kv = KVCacheManager(groups, num_blocks, max_model_len=cfg.max_model_len, enable_caching=False)
    sched = Scheduler(cfg, kv)
    sim = _Simulator(cfg, groups, num_blocks, 0, step_lookahead(cfg))
    mirrors: dict[str, Request] = {}
    for i, (prompt_len, max_tokens) in enumerate(reqs):
        prompt = [(7 * i + j) % 50 for j in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens)
        try:
            sched.add_request(Request(f"r{i}", list(prompt), params))
        except CapacityError:  # the pool could never hold it: the scheduler refuses it up front
            continue
        mirrors[f"r{i}"] = Request(f"r{i}", list(prompt), params)
    rng = random.Random(seed)
    for _ in range(400):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        if out.preempted_req_ids:
            break  # preemption frees blocks mid-step, which warmup never does
        entries = [
            _Entry(
                mirrors[c.req_id],
                out.num_scheduled_tokens[c.req_id],
                len(out.scheduled_spec_decode_tokens.get(c.req_id, ())),
                False,
            )
            for c in out.scheduled_cached_reqs
        ] + [
            _Entry(mirrors[n.req_id], out.num_scheduled_tokens[n.req_id], 0, True)
            for n in out.scheduled_new_reqs
        ]
        planned = sim.step("step", "decode", "the scheduler's step", entries)
        assert _records(planned.scheduler_output) == _records(out)
        for req_id, n in out.num_scheduled_tokens.items():
            assert sched.requests[req_id].num_computed_tokens == mirrors[req_id].num_computed_tokens
            assert sched.requests[req_id].num_computed_tokens <= cfg.max_model_len - 1, (req_id, n)
        result = _run(sched, out, cfg.num_speculative_tokens, rng)
        accepted = {
            r: max(len(s) - 1, 0) for r, s in zip(result.req_ids, result.sampled_token_ids, strict=True)
        }
        for step_out in sched.update_from_output(out, result):
            if step_out.finished:
                sim.manager.free(mirrors[step_out.req_id])
                del sim.running[step_out.req_id]
        sim.advance(entries, accepted)
        for req_id in out.num_scheduled_tokens:
            if req_id in sched.requests:
                assert sched.requests[req_id].num_tokens == mirrors[req_id].num_tokens


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(8, 64), st.data())
def test_planner_and_scheduler_stop_a_step_at_the_same_length(k, max_model_len, data):
    """The length cap: a step ends by max_model_len - 1 in both (the last position is the bonus
    token's). The scheduler cuts the drafts that would pass it; the planner refuses the step."""
    prompt_len = data.draw(st.integers(1, max_model_len - 2))
    cfg = _config(k=k, block_size=4, max_model_len=max_model_len, seqs=1, budget=64, chunked=True)
    groups = [KVCacheGroup("full", FullAttentionSpec(block_size=4))]
    sim = _Simulator(cfg, groups, 64, 0, step_lookahead(cfg))
    kv = KVCacheManager(groups, 64, max_model_len=max_model_len, enable_caching=False)
    sched = Scheduler(cfg, kv)
    req = Request("r", [1] * prompt_len, SamplingParams(max_tokens=4 * max_model_len))
    sched.add_request(req)
    mirror = sim.new_request("r", prompt_len)
    first = _Entry(mirror, prompt_len, 0, True)
    sim.step("prefill", "prefill", "", [first])
    sim.advance([first])
    out = sched.schedule()
    sched.update_from_output(out, _all_accepted(out, k))
    while True:
        want = 1 + k
        entry = _Entry(mirror, want, k, False)
        out = sched.schedule()
        if out.is_empty:  # the last step reached max_model_len: nothing more may run
            assert mirror.num_tokens == max_model_len
            with pytest.raises(_DoesNotFit, match="would pass max_model_len"):
                sim.step("decode", "decode", "", [entry])
            return
        got = out.num_scheduled_tokens["r"]
        if got < want:
            assert mirror.num_computed_tokens + want == max_model_len - 1 + (want - got)
            with pytest.raises(_DoesNotFit, match="would pass max_model_len"):
                sim.step("decode", "decode", "", [entry])
            return
        sim.step("decode", "decode", "", [entry])
        sim.advance([entry])
        sched.update_from_output(out, _all_accepted(out, k))
        assert req.num_computed_tokens == mirror.num_computed_tokens <= max_model_len - 1


def _run(sched: Scheduler, out: SchedulerOutput, k: int, rng: random.Random) -> ModelRunnerOutput:
    """A model that accepts a random prefix of each request's drafts and proposes up to k."""
    req_ids = list(out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        req = sched.requests[req_id]
        drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
        done = req.num_computed_tokens >= req.num_tokens
        sampled.append([*drafts[: rng.randint(0, len(drafts))], rng.randrange(50)] if done else [])
    proposals = {r: [rng.randrange(50) for _ in range(rng.randint(0, k))] for r in req_ids}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, draft_token_ids=proposals)


def _all_accepted(out: SchedulerOutput, k: int) -> ModelRunnerOutput:
    req_ids = list(out.num_scheduled_tokens)
    sampled = [[*out.scheduled_spec_decode_tokens.get(r, []), 5] for r in req_ids]
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled, draft_token_ids={r: [3] * k for r in req_ids}
    )
