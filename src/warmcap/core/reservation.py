"""The one reservation rule (invariant I1).

Every block count in warmcap comes from this module: the KV cache manager allocates with it, the
warmup planner plans with it, the audit checks against it. Nothing else does block arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable

from warmcap.core.kv_spec import CrossAttentionSpec, KVCacheGroup, KVSpec, MambaSpec, SlidingWindowSpec


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def reserved_blocks(
    spec: KVSpec,
    num_tokens: int,
    *,
    num_lookahead_tokens: int,
    max_model_len: int,
    max_encoder_len: int = 0,
) -> int:
    """Blocks a request must hold in a group of ``spec`` when ``num_tokens`` (computed + scheduled)
    tokens are in flight and the drafter may write ``num_lookahead_tokens`` more.

    - attention kinds (full, sliding window, MLA, indexer): ``cdiv(min(n + L, M), bs)``
    - Mamba, cache mode none/all: the same plus ``num_speculative_blocks``
    - Mamba, cache mode align: ``cdiv(n, bs) + num_speculative_blocks`` (no lookahead, no cap)
    - cross-attention: ``cdiv(max_encoder_len, bs)``
    """
    if num_tokens < 0 or num_lookahead_tokens < 0:
        raise ValueError(f"token counts must be >= 0; got {num_tokens=} {num_lookahead_tokens=}")
    bs = spec.block_size
    if isinstance(spec, CrossAttentionSpec):
        return cdiv(max_encoder_len, bs)
    if isinstance(spec, MambaSpec):
        if spec.cache_mode == "align":
            return cdiv(num_tokens, bs) + spec.num_speculative_blocks
        return cdiv(min(num_tokens + num_lookahead_tokens, max_model_len), bs) + spec.num_speculative_blocks
    return cdiv(min(num_tokens + num_lookahead_tokens, max_model_len), bs)


def skipped_blocks(spec: KVSpec, num_computed_tokens: int) -> int:
    """Leading blocks a request no longer reads (their columns hold the null block).

    ``num_computed_tokens`` counts every token whose KV or state exists (local, prefix hits and
    external). Sliding window: the next query sits at position ``p = num_computed_tokens`` and
    sees ``[p - window + 1, p]``, so whole blocks before ``p - window + 1`` can go. Mamba in modes
    ``all``/``align``: only the state after the last computed token is read again (block
    ``(p - 1) // bs``), so every block before it can go. Mamba in mode ``none`` keeps its states in
    columns ``0 .. k`` (its block spans the whole context), and other kinds read everything: zero.
    """
    if isinstance(spec, SlidingWindowSpec):
        first_needed = max(0, num_computed_tokens - spec.sliding_window + 1)
        return first_needed // spec.block_size
    if isinstance(spec, MambaSpec) and spec.cache_mode != "none":
        return max(0, num_computed_tokens - 1) // spec.block_size
    return 0


def stateless_columns(
    spec: KVSpec, num_computed_tokens: int, num_committed_tokens: int, *, num_live_columns: int = 1
) -> range:
    """Columns of a Mamba ``align`` step that neither hold the live state nor receive one.

    The live state sits in ``num_live_columns`` columns from ``block_of(num_computed_tokens - 1)``
    (more than one after a verify step: the state after accepted draft j is j columns further);
    the step writes the state after its last committed token to ``block_of(num_committed - 1)``
    and draft states to the k columns after it. Columns in between, which a long prefill chunk
    spans, stay null. Empty for every other kind and mode (``all`` writes every block boundary).
    """
    if not isinstance(spec, MambaSpec) or spec.cache_mode != "align" or num_committed_tokens < 1:
        return range(0)
    start = block_of(spec, num_computed_tokens - 1) + num_live_columns if num_computed_tokens else 0
    return range(start, block_of(spec, num_committed_tokens - 1))


def block_of(spec: KVSpec, position: int) -> int:
    """Block-table column that holds token ``position``."""
    return position // spec.block_size


def blocks_per_request(
    groups: Iterable[KVCacheGroup],
    num_tokens: int,
    *,
    num_lookahead_tokens: int,
    max_model_len: int,
    max_encoder_len: int = 0,
) -> dict[str, int]:
    """``reserved_blocks`` for every group, keyed by group name."""
    return {
        g.name: reserved_blocks(
            g.spec,
            num_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            max_model_len=max_model_len,
            max_encoder_len=max_encoder_len,
        )
        for g in groups
    }


def max_blocks_per_request(
    groups: Iterable[KVCacheGroup], *, num_lookahead_tokens: int, max_model_len: int, max_encoder_len: int = 0
) -> int:
    """Block-table width: the most blocks any request can hold in any group."""
    counts = blocks_per_request(
        groups,
        max_model_len,
        num_lookahead_tokens=num_lookahead_tokens,
        max_model_len=max_model_len,
        max_encoder_len=max_encoder_len,
    )
    return max(counts.values(), default=0)


def block_aligned_len(num_tokens: int, block_size: int) -> int:
    """``num_tokens`` rounded up to whole blocks: the context length that many tokens occupy."""
    return cdiv(num_tokens, block_size) * block_size


def blocks_covering(num_tokens, block_size: int):
    """Blocks that positions ``0 .. num_tokens - 1`` occupy — what an attention kernel reads, not
    what a request reserves. Works elementwise on integer tensors as well as on ints."""
    return (num_tokens + block_size - 1) // block_size
