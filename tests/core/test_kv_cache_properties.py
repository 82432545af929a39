"""Hypothesis properties of the KV cache manager over random specs and step sequences:
held blocks follow the one rule, nothing leaks, the null block is never handed out."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import event, given, settings
from hypothesis import strategies as st

from warmcap.core.kv_cache_manager import KVCacheManager
from warmcap.core.kv_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    IndexerSpec,
    KVCacheGroup,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)
from warmcap.core.request import Request
from warmcap.core.reservation import align_state_columns, reserved_blocks, skipped_blocks

BLOCK_SIZES = st.sampled_from([1, 2, 4, 8, 16])


@st.composite
def group_lists(draw: st.DrawFn, k: int) -> list[KVCacheGroup]:
    kinds = draw(
        st.lists(
            st.sampled_from(
                ["full", "sliding", "mla", "indexer", "mamba_none", "mamba_all", "mamba_align", "cross"]
            ),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    groups = []
    for kind in kinds:
        bs = draw(BLOCK_SIZES)
        if kind == "full":
            spec = FullAttentionSpec(block_size=bs)
        elif kind == "sliding":
            spec = SlidingWindowSpec(block_size=bs, sliding_window=draw(st.integers(1, 40)))
        elif kind == "mla":
            spec = MLASpec(block_size=bs)
        elif kind == "indexer":
            spec = IndexerSpec(block_size=bs)
        elif kind == "cross":
            spec = CrossAttentionSpec(block_size=bs)
        else:
            spec = MambaSpec(block_size=bs, cache_mode=kind.removeprefix("mamba_"), num_speculative_blocks=k)
        groups.append(KVCacheGroup(kind, spec))
    return groups


@dataclass
class Sim:
    request: Request
    rejected: bool = False  # True once a step rolled back drafts: blocks may then exceed the rule


def check_holdings(kv: KVCacheManager, sims: list[Sim], lookahead: dict[str, int]) -> None:
    """Every request holds the rule's count (or more after rejections); ref counts match holders."""
    holders: Counter[int] = Counter()
    for sim in sims:
        req = sim.request
        ids = kv.get_block_ids(req.request_id)
        if req.request_id not in lookahead:
            assert all(not v for v in ids.values())
            continue
        for m in kv.managers:
            expected = reserved_blocks(
                m.spec,
                req.num_computed_tokens,
                num_lookahead_tokens=lookahead[req.request_id],
                max_model_len=kv.max_model_len,
                max_encoder_len=req.num_encoder_tokens,
            )
            held = ids[m.name]
            if sim.rejected:
                assert len(held) >= expected
            else:
                assert len(held) == expected, (m.name, len(held), expected)
            released = skipped_blocks(m.spec, req.num_computed_tokens)
            if isinstance(m.spec, MambaSpec) and m.spec.cache_mode == "align" and not m.group.is_drafter:
                # The reference engine's layout: the columns a step writes states to (the running
                # state's and the k drafts', the last 1 + k) are real blocks.
                cols = align_state_columns(m.spec, len(held))
                assert all(held[c] != 0 for c in cols), ("state column left null", held)
            elif isinstance(m.spec, MambaSpec) and m.spec.cache_mode == "align":
                # A drafter's own groups keep the committed-state rule: the live state's column and
                # the last one (a draft's state) are real blocks.
                live = held[min(released, len(held) - 1)] if held else None
                assert not held or (held[-1] != 0 and live != 0), "state column left null"
            else:
                assert 0 not in held[released:], "null block handed out"
            holders.update(b for b in held if b != 0)
    assert all(kv.pool.blocks[b].ref_cnt == n for b, n in holders.items())
    assert kv.pool.null_block.ref_cnt == 0
    assert kv.pool.num_free_blocks == sum(1 for b in kv.pool.blocks[1:] if b.ref_cnt == 0)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), k=st.integers(0, 4), max_model_len=st.integers(8, 96), caching=st.booleans())
def test_held_blocks_follow_the_rule_and_nothing_leaks(data, k, max_model_len, caching):
    groups = data.draw(group_lists(k))
    num_blocks = data.draw(st.integers(2, 80))
    kv = KVCacheManager(
        groups,
        num_blocks,
        max_model_len=max_model_len,
        enable_caching=None if caching else False,
        max_encoder_len=20,
    )
    draw_int = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731
    shared_prefix = [draw_int(0, 3) for _ in range(draw_int(0, 32))]
    num_lookahead = draw_int(0, k + 1)
    consumers: set[str] = set()
    sims: list[Sim] = []
    lookahead: dict[str, int] = {}  # lookahead of each request's last successful allocation
    for step in range(draw_int(1, 40)):
        op = data.draw(st.sampled_from(["add", "step", "step", "step", "free"]))
        if op == "add" or not sims:
            prompt_len = draw_int(1, max_model_len - 1)
            prompt = (shared_prefix + [draw_int(0, 3) for _ in range(4)])[:prompt_len]
            sims.append(Sim(Request(f"r{step}", prompt, num_encoder_tokens=draw_int(0, 20))))
            if data.draw(st.booleans()):
                consumers.add(f"r{step}")
            continue
        sim = sims[draw_int(0, len(sims) - 1)]
        req = sim.request
        if op == "free" or req.num_tokens >= max_model_len:
            kv.free(req)
            sims.remove(sim)
            lookahead.pop(req.request_id, None)
            continue
        hits, num_hit = ({}, 0)
        if req.request_id not in lookahead:
            hits, num_hit = kv.get_computed_blocks(req)
            assert num_hit < req.num_tokens
        base = req.num_computed_tokens + num_hit
        remaining = req.num_tokens - base
        if remaining == 1 and req.output_token_ids:  # a decode: the last sampled token plus drafts
            num_new = min(1 + draw_int(0, k), max_model_len - base)
            drafts = num_new - 1
        else:
            num_new, drafts = draw_int(1, remaining), 0
        # A P/D consumer's loading step reserves no lookahead; every other step reserves L.
        lookahead_now = (
            0 if req.request_id in consumers and req.request_id not in lookahead else num_lookahead
        )
        before = (
            kv.pool.snapshot(),
            {s.request.request_id: kv.get_block_ids(s.request.request_id) for s in sims},
        )
        new_ids = kv.allocate_slots(
            req,
            num_new,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hits,
            num_lookahead_tokens=lookahead_now,
        )
        if num_hit:
            event("prefix hit")
        if new_ids is None:
            event("allocation refused")
            after = (
                kv.pool.snapshot(),
                {s.request.request_id: kv.get_block_ids(s.request.request_id) for s in sims},
            )
            assert after == before, "a failed allocation changed the pool"
            kv.free(req)  # preempt and recompute later
            req.num_computed_tokens = 0
            sim.rejected = False
            lookahead.pop(req.request_id, None)
            continue
        ids = kv.get_block_ids(req.request_id)
        for name, fresh in new_ids.items():
            assert ids[name][len(ids[name]) - len(fresh) :] == fresh
        req.num_computed_tokens = base + num_new
        lookahead[req.request_id] = lookahead_now
        check_holdings(kv, sims, lookahead)
        if req.num_computed_tokens >= req.num_tokens:
            accepted = draw_int(0, drafts)
            req.num_computed_tokens -= drafts - accepted
            sim.rejected = sim.rejected or accepted < drafts
            if accepted < drafts:
                event("drafts rejected")
            req.output_token_ids.extend(draw_int(0, 3) for _ in range(accepted + 1))
    for sim in sims:
        kv.free(sim.request)
    assert kv.pool.num_free_blocks == num_blocks - 1
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
