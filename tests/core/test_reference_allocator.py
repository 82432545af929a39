"""warmcap's KV cache manager against the reference engine's (vLLM) allocator, call by call.

Each trajectory drives one request through allocate / grow / accept / reject / free and, after
every call, compares the physical blocks the request holds per group (table columns that are not
the null block) with what vLLM's manager holds after the same call. vLLM's numbers are written
down from its source, ``vllm/v1/core/``:

- ``kv_cache_manager.py`` ``KVCacheManager.allocate_slots``: tokens needing a slot are
  ``min(computed + external + new + lookahead, max_model_len)``; ``remove_skipped_blocks`` runs
  with the total computed tokens (local, prefix hits and external) before new blocks are taken.
- ``single_type_kv_cache_manager.py``:
  ``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` / ``allocate_new_blocks``: a running
  request grows to ``cdiv(num_tokens, block_size)`` columns and never shrinks (rejected drafts
  keep their blocks); ``allocate_new_computed_blocks``: a new request's columns wholly outside
  the attention window for its external tokens get the null block, not a fresh one;
  ``remove_skipped_blocks`` puts the null block in columns before
  ``get_num_skipped_tokens(c) // block_size`` and frees what was there.
  ``SlidingWindowManager.get_num_skipped_tokens``: ``max(0, c - window + 1)``.
  ``MambaManager.get_num_skipped_tokens``: ``c - 1`` (only the state after the last computed
  token is needed). ``MambaManager.get_num_blocks_to_allocate`` / ``allocate_new_blocks``:
  modes ``none``/``all`` add ``num_speculative_blocks`` blocks of tokens to the base rule; mode
  ``align`` sizes ``cdiv(computed + new, block_size) + k`` columns (no lookahead), fills the
  columns before the running state with null blocks on a request's first allocation (taking
  ``1 + k`` blocks), later takes at most one block and moves the previous speculative blocks past
  the new running state (the columns they leave become null);
  ``MambaManager.remove_skipped_blocks`` in ``align`` also frees the previous running state.
- Mode ``none`` sizes a Mamba block to ``max_model_len`` (vLLM's ``MambaSpec`` without prefix
  caching), so a request holds ``1 + k`` state blocks whatever its length.

Mamba's first column included: where vLLM puts the null block there, so does warmcap (its
runner tells a row's request by its newest block, ``runner_v2/mamba_state.py``
``identity_blocks``), and the counts are vLLM's exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from warmcap.core.kv_cache_manager import KVCacheManager
from warmcap.core.kv_spec import FullAttentionSpec, KVCacheGroup, KVSpec, MambaSpec, SlidingWindowSpec
from warmcap.core.request import Request
from warmcap.core.reservation import reserved_blocks


@dataclass(frozen=True)
class Call:
    """One ``allocate_slots`` call: the request has ``computed`` tokens, ``real`` of its tokens are
    prompt + sampled output (the rest of ``scheduled`` are drafts), ``external`` come from a
    remote prefill; ``physical`` is what vLLM holds afterwards in the group."""

    computed: int
    scheduled: int
    lookahead: int
    real: int
    physical: int
    external: int = 0
    column0_null: bool = False  # vLLM's first column holds the null block after the call


def drive(
    spec: KVSpec, prompt_len: int, calls: list[Call], *, max_model_len: int = 4096, num_blocks: int = 256
):
    group = KVCacheGroup("g", spec)
    kv = KVCacheManager([group], num_blocks, max_model_len=max_model_len, enable_caching=False)
    req = Request("r", list(range(prompt_len)))
    for i, call in enumerate(calls):
        req.num_computed_tokens = call.computed
        while req.num_tokens < call.real:
            req.output_token_ids.append(7)
        assert (
            kv.allocate_slots(
                req,
                call.scheduled,
                num_lookahead_tokens=call.lookahead,
                num_external_computed_tokens=call.external,
            )
            is not None
        ), f"call {i} refused"
        ids = kv.get_block_ids("r")["g"]
        n = call.computed + call.external + call.scheduled
        columns = reserved_blocks(spec, n, num_lookahead_tokens=call.lookahead, max_model_len=max_model_len)
        assert len(ids) >= columns, f"call {i}: {len(ids)} columns, the rule says {columns}"
        physical = sum(1 for b in ids if b != 0)
        assert physical == call.physical, f"call {i}: warmcap holds {physical}, vLLM {call.physical}: {ids}"
        if isinstance(spec, MambaSpec):
            assert (ids[0] == 0) == call.column0_null, (
                f"call {i}: first column {ids[0]}, vLLM's null: {call.column0_null}"
            )
        assert kv.pool.num_free_blocks == num_blocks - 1 - physical
    kv.free(req)
    assert kv.pool.num_free_blocks == num_blocks - 1
    return kv


def test_full_attention_grows_and_keeps_rejected_blocks():
    # bs 16, EAGLE k=3 (lookahead 3); prompt 20
    drive(
        FullAttentionSpec(16),
        20,
        [
            Call(0, 20, 3, 20, physical=2),  # cdiv(23, 16)
            Call(20, 4, 3, 21, physical=2),  # cdiv(27, 16)
            Call(24, 4, 3, 25, physical=2),  # all 3 drafts accepted: cdiv(31, 16)
            Call(28, 4, 3, 29, physical=3),  # cdiv(35, 16)
            Call(29, 4, 3, 30, physical=3),  # all rejected: cdiv(36, 16) = 3
            Call(30, 1, 0, 31, physical=3),  # no drafts: cdiv(31, 16) = 2, keeps 3
        ],
    )


def test_sliding_window_releases_blocks_that_left_the_window():
    # bs 4, window 8: skipped tokens max(0, c - 7)
    drive(
        SlidingWindowSpec(4, sliding_window=8),
        12,
        [
            Call(0, 12, 0, 12, physical=3),
            Call(12, 1, 0, 13, physical=3),  # skip 5 tokens -> 1 null; 4 columns
            Call(13, 1, 0, 14, physical=3),  # skip 6 -> 1; 4 columns
            Call(16, 1, 0, 17, physical=3),  # skip 9 -> 2; 5 columns
            Call(24, 1, 0, 25, physical=3),  # skip 17 -> 4; 7 columns
        ],
    )


def test_sliding_window_consumer_first_step_leaves_blocks_outside_the_window_null():
    # 39 of 40 prompt tokens loaded from a remote prefill: skip 39 - 7 = 32 tokens = 8 blocks of 10
    kv = drive(
        SlidingWindowSpec(4, sliding_window=8),
        40,
        [
            Call(0, 1, 0, 40, physical=2, external=39),
            Call(40, 1, 0, 41, physical=3),  # skip 33 -> 8; 11 columns
        ],
    )
    assert kv.pool.num_free_blocks == 255


def test_sliding_window_consumer_fits_a_pool_too_small_for_the_whole_prompt():
    group = KVCacheGroup("g", SlidingWindowSpec(4, sliding_window=8))
    kv = KVCacheManager([group], 4, max_model_len=64)
    req = Request("r", list(range(40)), num_external_computed_tokens=39)
    # vLLM asks for 2 blocks here (8 of the 10 columns are outside the window); 3 are free
    assert kv.allocate_slots(req, 1, num_external_computed_tokens=39) == {"g": [0] * 8 + [1, 2]}


MAMBA = {"state_shapes": ((4, 8),), "num_speculative_blocks": 3}

# bs 16, MTP/EAGLE k=3 (lookahead 3), prompt 480: prefill, a verify step, all accepted (488
# tokens in flight), all rejected, then a step whose lookahead crosses a block boundary.
DECODE_STEPS = [
    (0, 480, 3, 480),
    (480, 4, 3, 481),
    (484, 4, 3, 485),
    (485, 4, 3, 486),
    (494, 4, 3, 495),
]


@pytest.mark.parametrize(
    ("mode", "block_size", "physical", "column0_null"),
    [
        # columns cdiv(min(n + 3, M), 2048) + 3 = 4, nothing skipped
        ("none", 4096, [4, 4, 4, 4, 4], [False] * 5),
        # columns cdiv(n + 3 + 48, 16): 34, 34, 34, 34, 35; skipped (c - 1) // 16: 0, 29, 30, 30, 30
        ("all", 16, [34, 5, 4, 4, 5], [False, True, True, True, True]),
        # columns cdiv(n, 16) + 3: 33, 34, 34, 34, 35; first step: 29 nulls + 1 + k blocks; then one
        # more block per step, the previous running state freed a step later
        ("align", 16, [4, 5, 4, 4, 5], [True] * 5),
    ],
)
def test_mamba_frees_state_blocks_behind_the_running_state(mode, block_size, physical, column0_null):
    spec = MambaSpec(block_size, cache_mode=mode, **MAMBA)
    calls = [
        Call(c, s, la, real, physical=p, column0_null=z)
        for (c, s, la, real), p, z in zip(DECODE_STEPS, physical, column0_null, strict=True)
    ]
    drive(spec, 480, calls, max_model_len=4096)


@pytest.mark.parametrize(
    ("mode", "physical", "column0_null"),
    [
        # columns cdiv(n + 2 + 32, 16): 5, 8, 9, 9; skipped (c - 1) // 16: 0, 2, 4, 6
        ("all", [5, 6, 5, 3], [False, True, True, True]),
        # columns cdiv(n, 16) + 2: 5, 7, 9, 9. Chunk 1: 2 nulls + 3 blocks (columns 2-4). Chunk 2:
        # running state moves to column 4, speculative block of column 3 moves to column 5, one new
        # block (6); column 2 is the previous state: {2, 4, 5, 6}. Chunk 3: column 2 freed, column
        # 5's block moves to 7, new block 8: {4, 6, 7, 8}. Verify step: column 4 freed: {6, 7, 8}.
        ("align", [3, 4, 4, 3], [True] * 4),
    ],
)
def test_mamba_chunked_prefill_then_decode(mode, physical, column0_null):
    spec = MambaSpec(16, state_shapes=((4, 8),), cache_mode=mode, num_speculative_blocks=2)
    steps = [(0, 40, 2, 100), (40, 40, 2, 100), (80, 20, 2, 100), (100, 3, 2, 101)]
    calls = [
        Call(c, s, la, real, physical=p, column0_null=z)
        for (c, s, la, real), p, z in zip(steps, physical, column0_null, strict=True)
    ]
    drive(spec, 100, calls)


def test_mamba_align_first_step_places_the_state_by_every_scheduled_token():
    # bs 4, k 2, lookahead 2, a 7-token first step of which only 4 tokens are the request's own
    # (the rest drafts): vLLM sizes cdiv(7, 4) + 2 = 4 columns and puts the running state in the
    # block of the last scheduled token (column 1), so column 0 is null: 3 blocks.
    spec = MambaSpec(4, state_shapes=((4, 8),), cache_mode="align", num_speculative_blocks=2)
    drive(spec, 4, [Call(0, 7, 2, 4, physical=3, column0_null=True)])
