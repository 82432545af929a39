"""Hypothesis properties of the scheduler driven by a fake runner with random acceptance:
limits hold every step, blocks follow the rule, and every request ends with its blocks returned."""

from __future__ import annotations

import random

from core_fakes import VOCAB, FakeRunner, make_request, make_scheduler
from hypothesis import event, given, settings
from hypothesis import strategies as st

from warmcap.config import SpeculativeConfig
from warmcap.core.kv_spec import FullAttentionSpec, KVCacheGroup, MambaSpec, SlidingWindowSpec
from warmcap.core.request import Request, RequestStatus
from warmcap.core.reservation import blocks_per_request, reserved_blocks
from warmcap.errors import CapacityError

SPECS = st.sampled_from([None, "ngram:2", "eagle:1", "eagle3:3", "mtp:2", "draft_model:2", "dflash:3"])


@settings(max_examples=200, deadline=None)
@given(
    spec=SPECS,
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_model_len=st.integers(8, 80),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 64),
    pool_factor=st.floats(1.0, 3.0),
    chunked=st.booleans(),
    caching=st.booleans(),
    extra_group=st.sampled_from([None, "sliding", "mamba"]),
    num_requests=st.integers(1, 12),
    prefill_cap=st.one_of(st.none(), st.integers(1, 64)),
)
def test_limits_hold_and_every_request_ends(
    spec,
    seed,
    block_size,
    max_model_len,
    max_num_seqs,
    budget,
    pool_factor,
    chunked,
    caching,
    extra_group,
    num_requests,
    prefill_cap,
):
    rng = random.Random(seed)
    if not chunked:
        prefill_cap = None  # refused without chunked prefill (tests/test_config.py)
    groups = [KVCacheGroup("full", FullAttentionSpec(block_size=block_size))]
    if extra_group == "sliding":
        groups.append(
            KVCacheGroup("sliding_window", SlidingWindowSpec(block_size=block_size, sliding_window=5))
        )
    elif extra_group == "mamba":
        k = int(spec.split(":")[1]) if spec else 0
        groups.append(
            KVCacheGroup("mamba", MambaSpec(block_size=8, cache_mode="all", num_speculative_blocks=k))
        )
    # Enough blocks for one request of max_model_len tokens, up to three times that: requests compete.
    config = SpeculativeConfig.parse(spec)
    lookahead = config.lookahead if config else 0
    one = sum(
        blocks_per_request(
            groups, max_model_len, num_lookahead_tokens=lookahead, max_model_len=max_model_len
        ).values()
    )
    num_blocks = int(one * pool_factor) + 1
    sched = make_scheduler(
        spec=spec,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        chunked_prefill=chunked,
        # None: on wherever the groups can serve hits (True would refuse a Mamba hybrid)
        enable_caching=None if caching else False,
        groups=groups,
        eos_token_id=0,
        max_prefill_tokens_with_decodes=prefill_cap,
    )
    runner = FakeRunner(rng, sched.num_spec_tokens)
    shared = [rng.randrange(VOCAB) for _ in range(20)]
    added: dict[str, Request] = {}
    pending = num_requests
    step = 0
    while pending or sched.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            pending -= 1
            prompt_len = rng.randint(1, max_model_len)
            prompt = (shared[: rng.randint(0, 20)] + [rng.randrange(VOCAB) for _ in range(prompt_len)])[
                :prompt_len
            ]
            req = make_request(f"r{pending}", prompt, max_tokens=rng.randint(1, 30))
            try:
                sched.add_request(req)
            except (CapacityError, ValueError):
                event("request refused at add")
                continue
            added[req.request_id] = req
        if sched.running and rng.random() < 0.05:
            sched.abort_request(rng.choice(sched.running).request_id)
        computed_before = {r.request_id: r.num_computed_tokens for r in sched.running}
        out = sched.schedule()
        step += 1
        assert step < 3000, "no progress"
        assert out.total_num_scheduled_tokens <= budget
        assert out.num_reqs <= max_num_seqs and len(sched.running) <= max_num_seqs
        assert all(n >= 1 for n in out.num_scheduled_tokens.values())
        start = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
        start.update({d.req_id: d.num_computed_tokens for d in out.scheduled_cached_reqs})
        assert start.keys() == out.num_scheduled_tokens.keys()
        # The prompt allowance: beside a decode, new and resumed requests and running prompt chunks
        # compute at most the cap together.
        fresh = {d.req_id for d in out.scheduled_new_reqs}
        prompt_tokens = sum(
            n
            for r, n in out.num_scheduled_tokens.items()
            if r in fresh or start[r] < sched.requests[r].num_tokens - 1
        )
        if (
            prefill_cap is not None
            and len(fresh) < out.num_reqs
            and prompt_tokens < out.total_num_scheduled_tokens
        ):
            event("prompt tokens beside decodes")
            assert prompt_tokens <= prefill_cap
        for req_id, n in out.num_scheduled_tokens.items():
            req = sched.requests[req_id]
            assert start[req_id] + n <= max_model_len
            assert req.num_computed_tokens == start[req_id] + n
            if req_id in computed_before:
                assert start[req_id] == computed_before[req_id]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            assert len(drafts) <= sched.num_spec_tokens
            assert start[req_id] + n - len(drafts) <= req.num_tokens
            for m in sched.kv.managers:
                need = reserved_blocks(
                    m.spec,
                    start[req_id] + n,
                    num_lookahead_tokens=out.num_lookahead_tokens[req_id],
                    max_model_len=max_model_len,
                )
                assert sched.kv.num_held_blocks(req_id)[m.name] >= need
        if out.preempted_req_ids:
            event("preemption")
        if out.scheduled_spec_decode_tokens:
            event("drafts verified")
        results = sched.update_from_output(out, runner.execute(sched, out))
        for result in results:
            req = added[result.req_id]
            assert result.finished or req.num_computed_tokens == req.num_tokens - 1, (
                "rejected drafts not rolled back"
            )
        assert all(r.num_computed_tokens < r.num_tokens for r in sched.running)
    assert all(r.status.finished for r in added.values())
    for req in added.values():
        assert req.num_tokens <= max_model_len
        assert req.num_output_tokens <= req.sampling_params.max_tokens
        if req.status is not RequestStatus.FINISHED_ABORTED:
            assert req.num_output_tokens >= 1
    assert sched.kv.pool.num_free_blocks == num_blocks - 1
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)
    # one more step reports the last finished ids and then nothing is left
    sched.schedule()
    assert not sched.schedule().finished_req_ids
