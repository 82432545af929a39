"""The one reservation rule (invariant I1).

Every block count in warmcap comes from this module: the KV cache manager allocates with it, the
warmup planner plans with it, the audit checks against it. Nothing else does block arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class AlignState:
    """What a target Mamba ``align`` group remembers of one request between its calls."""

    #: column of the running state: the last ``1 + k`` columns hold it and the draft states (-1:
    #: nothing allocated yet)
    anchor: int = -1
    #: the previous running state's column (-1: none); it goes once the computed tokens have left
    #: its block behind
    last_state: int = -1
    #: state columns kept behind the anchor: the reference engine's column -> the table column
    #: that holds the block in its place (they differ when the live state sits in a draft column)
    kept: dict[int, int] = field(default_factory=dict)
    #: committed (non-draft) tokens after the last call: where the live state is after acceptance
    num_committed: int = 0


@dataclass(frozen=True, slots=True)
class AlignStep:
    """One call's change to a request's Mamba ``align`` columns (:func:`align_step`)."""

    released: tuple[int, ...]  # held columns whose blocks go back to the pool
    nulls: tuple[range, ...]  # new columns that get the null block
    state: AlignState  # the request's state once the call succeeds


def align_step(
    spec: MambaSpec,
    state: AlignState,
    num_held: int,
    num_computed_tokens: int,
    num_tokens: int,
    num_committed_tokens: int,
) -> AlignStep:
    """The reference engine's (vLLM ``MambaManager``, cache mode ``align``) column bookkeeping for
    one allocation of a target model's Mamba group: ``num_held`` columns so far,
    ``num_computed_tokens`` computed, ``num_tokens`` computed + scheduled (drafts included),
    ``num_committed_tokens`` of them the request's own.

    - The table grows to ``reserved_blocks`` = ``cdiv(n, bs) + k`` columns and never shrinks. The
      running state goes to the block of the last *scheduled* token, drafts included
      (``anchor = cdiv(n, bs) - 1``); the ``k`` columns after it take the draft states. Columns
      before the anchor that a growth adds are null.
    - At a growth the previous anchor becomes ``last_state`` and is kept; the previous draft
      columns before the new anchor go back (the reference engine moves those blocks past the new
      anchor; warmcap's runner table only appends, so it frees them and takes fresh ones: the
      same count). The live state after accepted drafts may sit in one of them: then that column
      is kept *in place of* the previous anchor, so the count stays the reference's.
    - Before growing, with ``c`` computed tokens: kept columns wholly behind block
      ``(c - 1) // bs``, walking back from it until a column that holds nothing, go back; so does
      ``last_state`` once it is behind that block.
    """
    k = spec.num_speculative_blocks
    c = num_computed_tokens
    kept = dict(state.kept)
    last_state = state.last_state
    released: list[int] = []
    if c >= 2:
        col = min(block_of(spec, c - 1), num_held) - 1
        while col in kept:
            released.append(kept.pop(col))
            col -= 1
    if c >= 1 and 0 <= last_state < block_of(spec, c - 1) and last_state in kept:
        released.append(kept.pop(last_state))
    anchor = state.anchor
    nulls: tuple[range, ...] = ()
    stop = reserved_blocks(spec, num_tokens, num_lookahead_tokens=0, max_model_len=num_tokens)
    if stop > num_held:
        anchor = stop - 1 - k
        if state.anchor >= 0:
            old = state.anchor
            live = old + min(max(0, c - state.num_committed), k)
            keep = live if live < anchor else old
            kept[old] = keep
            last_state = old
            released.extend(col for col in range(old + 1, min(old + k + 1, anchor)) if col != keep)
            if keep != old:
                released.append(old)
            nulls = (range(num_held, anchor),)
        elif c >= 1:
            # A loaded state (P/D consumer): its block's column gets a block before the step's.
            loaded = block_of(spec, c - 1)
            last_state = loaded
            if loaded < anchor:
                kept[loaded] = loaded
            nulls = (range(num_held, loaded), range(loaded + 1, anchor))
        else:
            nulls = (range(num_held, anchor),)
    new_state = AlignState(anchor, last_state, kept, num_committed_tokens)
    return AlignStep(tuple(released), nulls, new_state)


def align_state_columns(spec: MambaSpec, num_held: int) -> range:
    """Mamba ``align``, target model: the columns of a table ``num_held`` wide that a step writes
    states to — the running state's and the ``k`` draft states' (the last ``1 + k``)."""
    return range(max(0, num_held - 1 - spec.num_speculative_blocks), num_held)


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
