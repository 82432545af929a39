"""The warmup planner's steps are the scheduler's steps (core/step_builder.py, core/scheduler.py).

Two directions. The steps ``plan_warmup`` returns are served by a real scheduler fed the same
requests, and must come out row for row the same: the runner's row order, each row's tokens,
position, drafts and blocks, and the requests the step tells the runner are finished. And the
scheduler serves a random request stream whose every step the planner's simulator rebuilds from
the same requests. A check that only one of them makes (a length cap, a budget, a sequence limit,
another lookahead, another row order, another result rule) makes the two steps differ.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from warmcap.core.kv_cache_manager import KVCacheManager
from warmcap.core.kv_spec import (
    FullAttentionSpec,
    IndexerSpec,
    KVCacheGroup,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)
from warmcap.core.outputs import ModelRunnerOutput, SchedulerOutput
from warmcap.core.request import Request, RequestStatus
from warmcap.core.scheduler import Scheduler
from warmcap.core.step_rules import step_lookahead
from warmcap.errors import CapacityError
from warmcap.sampling_params import SamplingParams
from warmcap.warmup.plan import WarmupPlan, WarmupStep
from warmcap.warmup.planner import _DoesNotFit, _Entry, _Simulator, plan_warmup


def _config(
    *,
    k: int,
    block_size: int,
    max_model_len: int,
    seqs: int,
    budget: int,
    chunked: bool,
    prefill_cap: int | None = None,
) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(block_size=block_size, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_seqs=seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            max_prefill_tokens_with_decodes=prefill_cap,
        ),
        speculative=SpeculativeConfig.parse(f"eagle:{k}" if k else None),
    )


def _records(out: SchedulerOutput) -> dict:
    """What the runner reads from a step (draft token ids aside: the planner's are dummies). The
    rows are a list: the runner lays a step out in ``num_scheduled_tokens`` order."""
    return {
        "rows": list(out.num_scheduled_tokens.items()),
        "finished": out.finished_req_ids,
        "new": [
            (n.req_id, list(n.prompt_token_ids), n.block_ids, n.num_computed_tokens, n.output_token_ids)
            for n in out.scheduled_new_reqs
        ],
        "cached": [
            (c.req_id, dict(c.new_block_ids), c.num_computed_tokens) for c in out.scheduled_cached_reqs
        ],
        "lookahead": list(out.num_lookahead_tokens.items()),
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
        # the prompt allowance beside decodes (needs chunked prefill)
        prefill_cap=draw(st.one_of(st.none(), st.integers(1, budget))) if chunked else None,
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
        sched.update_from_output(out, result)
        # The simulator's result step finishes (and frees) exactly the requests the scheduler did.
        sim.advance(planned, accepted)
        assert list(sim.running) == [r.request_id for r in sched.running]
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
    mirror = sim.new_request(prompt_len)
    sim.run("prefill", "prefill", "", [_Entry(mirror, prompt_len, 0, True)])
    out = sched.schedule()
    sched.update_from_output(out, _all_accepted(out, k))
    while True:
        want = 1 + k
        entry = _Entry(mirror, want, k, False)
        out = sched.schedule()
        if out.is_empty:  # the last step reached max_model_len: nothing more may run
            assert mirror.num_tokens == max_model_len
            # ... and both finished the request there, freeing its blocks
            assert mirror.request_id not in sim.running
            assert sim.manager.pool.num_free_blocks == kv.pool.num_free_blocks == 63
            with pytest.raises(_DoesNotFit, match="would pass max_model_len"):
                sim.step("decode", "decode", "", [entry])
            return
        got = out.num_scheduled_tokens["r"]
        if got < want:
            assert mirror.num_computed_tokens + want == max_model_len - 1 + (want - got)
            with pytest.raises(_DoesNotFit, match="would pass max_model_len"):
                sim.step("decode", "decode", "", [entry])
            return
        sim.run("decode", "decode", "", [entry])
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


# ------------------------------------------------------------------ the production plan's steps


def _serve(
    cfg: EngineConfig, groups: list[KVCacheGroup], num_blocks: int, plan: WarmupPlan
) -> Iterator[tuple[WarmupStep, SchedulerOutput, dict[str, dict[str, list[int]]]]]:
    """A real scheduler, over a pool of the plan's size, serving the plan's requests: each planned
    step's new prompts wait, the running requests it leaves out sit out of the running list (a
    planned step may decode some of them alone), and its rows' drafts are the drafter's proposals.
    Yields each planned step with the step the scheduler built and the blocks every scheduled
    request then holds; then every draft is accepted, as the plan assumes."""
    kv = KVCacheManager(groups, num_blocks, max_model_len=cfg.max_model_len, enable_caching=False)
    sched = Scheduler(replace(cfg, scheduler=replace(cfg.scheduler, async_scheduling=False)), kv)
    admitted: dict[str, int] = {}
    for step in plan.steps:
        so = step.scheduler_output
        rows = so.num_scheduled_tokens
        for new in so.scheduled_new_reqs:
            req = Request(new.req_id, list(new.prompt_token_ids), SamplingParams(max_tokens=1 << 20))
            # NOTE: past add_request's up-front refusal of a request that could one day outgrow the
            # pool (warmup's stop after their planned steps); admission is still the scheduler's.
            req.status = RequestStatus.WAITING
            sched.requests[req.request_id] = req
            sched.waiting.append(req)
            admitted[req.request_id] = len(admitted)
        idle = [r for r in sched.running if r.request_id not in rows]
        sched.running = [r for r in sched.running if r.request_id in rows]
        for req in sched.running:
            req.spec_token_ids = [5] * len(so.scheduled_spec_decode_tokens.get(req.request_id, ()))
        out = sched.schedule()
        yield step, out, {r: kv.get_block_ids(r) for r in out.num_scheduled_tokens}
        sampled = [
            [*out.scheduled_spec_decode_tokens.get(r, ()), 1]
            if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
            else []
            for r in out.num_scheduled_tokens
        ]
        sched.update_from_output(
            out, ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)
        )
        sched.running = sorted(idle + sched.running, key=lambda r: admitted[r.request_id])


def _assert_served_row_for_row(cfg, groups, num_blocks, plan: WarmupPlan) -> list[str]:
    """Every planned step is the scheduler's step; returns the names of the steps checked."""
    checked = []
    for step, out, held in _serve(cfg, groups, num_blocks, plan):
        assert not out.preempted_req_ids, step.name
        assert _records(step.scheduler_output) == _records(out), step.name
        started = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        started.update((c.req_id, c.num_computed_tokens) for c in out.scheduled_cached_reqs)
        served = [
            (r, started[r], n, len(out.scheduled_spec_decode_tokens.get(r, ())), held[r])
            for r, n in out.num_scheduled_tokens.items()
        ]
        planned = [
            (r.req_id, r.num_computed_tokens, r.num_scheduled_tokens, r.num_spec_tokens, r.blocks)
            for r in step.requests
        ]
        assert planned == served, step.name
        checked.append(step.name)
    return checked


def _groups(kinds: tuple[str, ...], bs: int, k: int) -> list[KVCacheGroup]:
    out = [KVCacheGroup("full", FullAttentionSpec(bs, num_kv_heads=2, head_size=8), ("l0",))]
    if "swa" in kinds:
        out.append(KVCacheGroup("swa", SlidingWindowSpec(bs, 2, 8, sliding_window=8), ("l1",)))
    if "mla" in kinds:
        out.append(KVCacheGroup("mla", MLASpec(bs, kv_lora_rank=16, qk_rope_head_dim=8), ("l2",)))
        out.append(KVCacheGroup("indexer", IndexerSpec(bs, head_size=8), ("l2.indexer",)))
    if "mamba" in kinds:
        spec = MambaSpec(bs * 2, state_shapes=((2, 4),), cache_mode="all", num_speculative_blocks=k)
        out.append(KVCacheGroup("mamba", spec, ("m0",)))
    return out


@pytest.mark.parametrize(
    ("spec", "kinds", "bs", "mml", "seqs", "budget", "num_blocks", "cap"),
    [
        (None, (), 16, 512, 4, 512, 256, None),
        ("eagle:2", (), 16, 512, 4, 512, 256, None),
        ("ngram:3", ("swa",), 8, 256, 3, 32, 128, None),
        ("mtp:1", ("mla",), 16, 512, 4, 512, 256, None),
        ("eagle:3", ("mamba",), 8, 256, 4, 64, 256, None),
        # The boundary request reaches max_model_len and finishes: its seat and blocks go to the
        # prompt that joins the running decodes, as the scheduler hands them out.
        ("ngram:1", ("swa",), 16, 18, 2, 16, 29, None),
        # A prompt allowance below the joining prompt: it joins with its first chunk.
        ("eagle:3", (), 16, 512, 4, 512, 256, 2),
        ("mtp:1", ("mla",), 16, 512, 4, 512, 256, 1),
    ],
)
def test_the_mixed_step_is_the_scheduler_mixed_step_row_for_row(
    spec, kinds, bs, mml, seqs, budget, num_blocks, cap
):
    """Warmup captures and audits the mixed layout serving emits: the running decodes first, in
    the order they were admitted, with their drafts, then the prompt that joins them; each row at
    the scheduler's position with the scheduler's blocks."""
    cfg = EngineConfig(
        cache=CacheConfig(block_size=bs, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_seqs=seqs,
            max_num_batched_tokens=budget,
            max_model_len=mml,
            max_prefill_tokens_with_decodes=cap,
        ),
        speculative=SpeculativeConfig.parse(spec),
    )
    groups = _groups(kinds, bs, cfg.num_speculative_tokens)
    plan = plan_warmup(cfg, groups, num_blocks)
    mixed = [s for s in plan.steps if s.kind in ("mixed", "sparse_mla")]
    assert [s.kind for s in mixed] == (["mixed", "sparse_mla"] if "mla" in kinds else ["mixed"])
    order = plan.req_ids
    for step in mixed:
        ids = [r.req_id for r in step.requests]
        new = [n.req_id for n in step.scheduler_output.scheduled_new_reqs]
        assert len(new) == 1 and ids[-1] == new[0], step.name
        assert ids[:-1] == sorted(ids[:-1], key=order.index), step.name
        k = cfg.num_speculative_tokens
        assert all(r.num_spec_tokens == k and r.num_computed_tokens for r in step.requests[:-1])
        joined = step.requests[-1].num_scheduled_tokens
        assert joined == (1 + cfg.uniform_decode_query_len if cap is None else cap), step.name
    assert {s.name for s in mixed} <= set(_assert_served_row_for_row(cfg, groups, num_blocks, plan))


@st.composite
def plans(draw):
    k = draw(st.integers(0, 3))
    method = draw(st.sampled_from(["eagle", "ngram", "mtp"]))
    bs = draw(st.sampled_from([2, 4, 8, 16]))
    cfg = EngineConfig(
        cache=CacheConfig(block_size=bs, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_seqs=draw(st.integers(1, 5)),
            max_num_batched_tokens=draw(st.sampled_from([4, 8, 16, 64])),
            max_model_len=draw(st.integers(6, 64)),
            enable_chunked_prefill=draw(st.booleans()),
        ),
        speculative=SpeculativeConfig.parse(f"{method}:{k}" if k else None),
    )
    kinds = draw(st.sampled_from([(), ("swa",), ("mla",), ("swa", "mla"), ("mamba",)]))
    groups, num_blocks = _groups(kinds, bs, k), draw(st.integers(2, 80))
    if draw(st.booleans()):
        # A context that ends where one warmup request's last step ends: there the scheduler ends
        # the request, and the steps after it run with its seat and blocks free.
        try:
            plan = plan_warmup(cfg, groups, num_blocks)
        except CapacityError:
            return cfg, groups, num_blocks
        last = {
            r.req_id: r.num_computed_tokens + r.num_scheduled_tokens + 1
            for s in plan.steps
            for r in s.requests
        }
        mml = draw(st.sampled_from(sorted(set(last.values()))))
        cfg = replace(cfg, scheduler=replace(cfg.scheduler, max_model_len=mml))
    return cfg, groups, num_blocks


@settings(max_examples=300, deadline=None)
@given(plans())
def test_every_step_plan_warmup_returns_is_the_scheduler_step(case):
    """The production plan itself, not a replay the test builds: a real scheduler serving the
    plan's requests emits each of its steps row for row, and ends and frees the same requests."""
    cfg, groups, num_blocks = case
    try:
        plan = plan_warmup(cfg, groups, num_blocks)
    except CapacityError:
        return
    assert _assert_served_row_for_row(cfg, groups, num_blocks, plan) == [s.name for s in plan.steps]
