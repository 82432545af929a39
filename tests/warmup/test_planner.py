from __future__ import annotations

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from warmcap.core.kv_spec import (
    FullAttentionSpec,
    IndexerSpec,
    KVCacheGroup,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)
from warmcap.core.reservation import align_state_columns, reserved_blocks, skipped_blocks, stateless_columns
from warmcap.errors import CapacityError
from warmcap.warmup.plan_view import plan_schema
from warmcap.warmup.planner import plan_warmup


def _config(spec: str | None, *, block_size=16, max_model_len=512, max_num_seqs=8, budget=512, role="none"):
    return EngineConfig(
        cache=CacheConfig(block_size=block_size),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len
        ),
        speculative=SpeculativeConfig.parse(spec),
        kv_role=role,
    )


def _full(bs: int) -> list[KVCacheGroup]:
    return [KVCacheGroup("full", FullAttentionSpec(bs, num_kv_heads=2, head_size=8), ("l0",))]


def assert_plan_follows_rule(plan, config) -> None:
    """Every planned request holds exactly the rule's count; ids are distinct and never the null
    block (except columns the rule releases: sliding-window and Mamba columns left behind, and a
    Mamba ``align`` step's stateless columns)."""
    mml = config.max_model_len
    for step in plan.steps:
        owners: dict[int, str] = {}
        for r in step.requests:
            n = r.num_computed_tokens + r.num_scheduled_tokens
            for g in plan.kv_groups:
                ids = r.blocks[g.name]
                want = reserved_blocks(
                    g.spec, n, num_lookahead_tokens=r.num_lookahead_tokens, max_model_len=mml
                )
                assert len(ids) == want, (step.name, r.req_id, g.name, len(ids), want)
                released = skipped_blocks(g.spec, r.num_computed_tokens)
                # Mamba ``align``: columns a step neither reads a state from nor writes one to stay
                # null (at most those between the live state and the committed tokens' last block).
                committed = r.num_computed_tokens + r.num_scheduled_tokens - r.num_spec_tokens
                stateless = stateless_columns(g.spec, r.num_computed_tokens, committed)
                # A target's ``align`` group (the reference engine's layout): only the last 1 + k
                # columns, where the step's states go, must hold blocks.
                target_align = (
                    isinstance(g.spec, MambaSpec) and g.spec.cache_mode == "align" and not g.is_drafter
                )
                for col, b in enumerate(ids):
                    if target_align and col not in align_state_columns(g.spec, len(ids)) and b == 0:
                        continue
                    if (col < released or col in stateless) and b == 0:
                        continue
                    assert b != 0, (step.name, r.req_id, g.name, "null block handed out")
                    assert owners.setdefault(b, r.req_id) == r.req_id, (step.name, b, "shared")


def test_dflash_k7_first_prefill_holds_two_blocks_and_lookahead_is_owned():
    cfg = _config("dflash:7")
    plan = plan_warmup(cfg, _full(16), 256)
    prefill = plan.steps[0]
    assert prefill.kind == "prefill"
    for r in prefill.requests:
        assert r.num_scheduled_tokens == 9
        assert len(r.blocks["full"]) == 2
        # the drafter writes positions 9..16 (k+1 = 8 of them): every one must be in an owned block
        assert (9 + cfg.num_lookahead_tokens - 1) // 16 < len(r.blocks["full"])


def test_eagle_k3_decode_steps_cross_from_one_block_to_two():
    plan = plan_warmup(_config("eagle:3"), _full(16), 256)
    counts = [
        len(r.blocks["full"])
        for s in plan.steps
        if s.kind == "decode"
        for r in s.requests
        if r.req_id == "warmup-0"
    ]
    assert counts[0] == 1 and 2 in counts
    assert counts == sorted(counts)


def test_plan_crosses_a_boundary_through_lookahead_then_tokens():
    plan = plan_warmup(_config("eagle:3"), _full(16), 256)
    how = [
        r.crossed.get("full") for s in plan.steps if s.name.startswith("boundary_decode") for r in s.requests
    ]
    assert how[:2] == ["lookahead", "tokens"]


def test_prefill_prompt_is_never_a_uniform_decode_length():
    for k in range(1, 9):
        cfg = _config(f"eagle:{k}")
        plan = plan_warmup(cfg, _full(16), 512)
        assert all(r.num_scheduled_tokens == cfg.uniform_decode_query_len + 1 for r in plan.steps[0].requests)


def test_mixed_and_sparse_mla_steps_exist_for_latent_models():
    groups = [
        KVCacheGroup("mla", MLASpec(16, kv_lora_rank=32, qk_rope_head_dim=8), ("l0",)),
        KVCacheGroup("indexer", IndexerSpec(16, head_size=16), ("l0.indexer",)),
    ]
    plan = plan_warmup(_config("mtp:1"), groups, 256)
    kinds = {s.kind for s in plan.steps}
    assert {"prefill", "decode", "mixed", "sparse_mla"} <= kinds
    mixed = next(s for s in plan.steps if s.kind == "sparse_mla")
    assert any(r.num_computed_tokens == 0 for r in mixed.requests)
    assert any(r.num_spec_tokens for r in mixed.requests)


def test_request_count_is_capped_by_free_blocks():
    big = plan_warmup(_config("eagle:3", max_num_seqs=16), _full(16), 512)
    small = plan_warmup(_config("eagle:3", max_num_seqs=16), _full(16), 6)
    assert len(small.steps[0].requests) < len(big.steps[0].requests)
    assert_plan_follows_rule(small, _config("eagle:3", max_num_seqs=16))
    assert {s.name for s in small.skipped} <= {"block_boundary", "mixed_prefill_decode"}


def test_impossible_pool_says_how_many_blocks_are_needed():
    with pytest.raises(CapacityError, match=r"at least \d+"):
        plan_warmup(_config("dflash:7", block_size=8), _full(8), 2)


def test_producer_plans_without_lookahead_and_drafts():
    plan = plan_warmup(_config("eagle:3", role="producer"), _full(16), 256)
    assert plan.num_lookahead_tokens == 0
    assert all(r.num_spec_tokens == 0 and r.num_lookahead_tokens == 0 for s in plan.steps for r in s.requests)


def test_json_matches_documented_schema():
    groups = [
        *_full(16),
        KVCacheGroup(
            "mamba",
            MambaSpec(512, state_shapes=((4, 8),), cache_mode="all", num_speculative_blocks=3),
            ("m0",),
        ),
    ]
    data = plan_warmup(_config("eagle:3"), groups, 256).to_json()
    jsonschema.validate(data, plan_schema())
    assert data["kv_groups"][1]["cache_mode"] == "all"
    assert data["steps"][0]["requests"][0]["blocks"].keys() == {"full", "mamba"}


METHODS = ["eagle", "eagle3", "mtp", "draft_model", "dflash", "ngram", None]


@st.composite
def configs(draw):
    method = draw(st.sampled_from(METHODS))
    k = draw(st.integers(1, 8))
    bs = draw(st.sampled_from([8, 16, 32, 64]))
    mml = draw(st.integers(64, 2048))
    spec = f"{method}:{k}" if method else None
    cfg = _config(
        spec,
        block_size=bs,
        max_model_len=mml,
        max_num_seqs=draw(st.integers(1, 8)),
        budget=draw(st.sampled_from([32, 128, 512])),
    )
    groups = [KVCacheGroup("full", FullAttentionSpec(bs, num_kv_heads=2, head_size=8), ("l0",))]
    if draw(st.booleans()):
        groups.append(
            KVCacheGroup(
                "sliding", SlidingWindowSpec(bs, 2, 8, sliding_window=draw(st.integers(4, 64))), ("l1",)
            )
        )
    if draw(st.booleans()):
        groups.append(KVCacheGroup("mla", MLASpec(bs, kv_lora_rank=16, qk_rope_head_dim=8), ("l2",)))
        groups.append(KVCacheGroup("indexer", IndexerSpec(bs, head_size=8), ("l2.indexer",)))
    if draw(st.booleans()):
        mode = draw(st.sampled_from(["none", "all", "align"]))
        mbs = mml if mode == "none" else bs * draw(st.sampled_from([1, 2, 4]))
        spec_blocks = cfg.num_speculative_tokens
        groups.append(
            KVCacheGroup(
                "mamba",
                MambaSpec(mbs, state_shapes=((2, 4),), cache_mode=mode, num_speculative_blocks=spec_blocks),
                ("m0",),
            )
        )
    num_blocks = draw(st.integers(2, 600))
    return cfg, groups, num_blocks


@settings(max_examples=200, deadline=None)
@given(configs())
def test_every_planned_request_holds_exactly_the_rule(case):
    cfg, groups, num_blocks = case
    try:
        plan = plan_warmup(cfg, groups, num_blocks)
    except CapacityError as exc:
        assert "at least" in str(exc)
        return
    assert plan.steps and plan.steps[0].kind == "prefill"
    assert_plan_follows_rule(plan, cfg)
    for step in plan.steps:
        so = step.scheduler_output
        assert so.total_num_scheduled_tokens <= cfg.scheduler.max_num_batched_tokens
        assert so.num_reqs <= cfg.scheduler.max_num_seqs
        for r in step.requests:
            assert r.num_computed_tokens + r.num_scheduled_tokens <= cfg.max_model_len - 1


@pytest.mark.parametrize("spec", ["dflash:7", "eagle:8"])
def test_consumer_warmup_plans_with_the_full_lookahead(spec: str) -> None:
    """The seed's two deterministic cases: a P/D consumer computes its warmup requests locally, so
    each reserves the full lookahead — the same plan a colocated instance makes."""
    consumer = _config(spec, role="consumer")
    plan = plan_warmup(consumer, _full(16), 256)
    assert plan.num_lookahead_tokens == consumer.num_lookahead_tokens == 8
    assert all(r.num_lookahead_tokens == 8 for s in plan.steps for r in s.requests)
    # the first prefill (1 + (1 + k) tokens) plus 8 lookahead slots passes position 15: two blocks
    assert all(len(r.blocks["full"]) == 2 for r in plan.steps[0].requests)
    assert_plan_follows_rule(plan, consumer)
    assert plan.to_json() == plan_warmup(_config(spec), _full(16), 256).to_json()


@pytest.mark.parametrize(("spec", "mml"), [(None, 512), (None, 10), ("eagle:3", 512), ("eagle:3", 16)])
def test_async_scheduling_plans_the_same_warmup(spec: str | None, mml: int) -> None:
    """Warmup runs its steps one at a time: a config that serves with async scheduling plans the
    steps, results and finishes of a synchronous one (with a short context a warmup request ends at
    max_model_len and the next step tells the runner)."""
    from dataclasses import replace

    cfg = _config(spec, block_size=8, max_model_len=mml, max_num_seqs=3)
    on = replace(cfg, scheduler=replace(cfg.scheduler, async_scheduling=True))
    plain, eager = plan_warmup(cfg, _full(8), 64), plan_warmup(on, _full(8), 64)
    assert plain.to_json() == eager.to_json()
    finished = [s.scheduler_output.finished_req_ids for s in plain.steps]
    assert finished == [s.scheduler_output.finished_req_ids for s in eager.steps]
    assert any(finished) == (mml < 512)
