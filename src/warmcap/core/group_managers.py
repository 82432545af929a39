"""Per-group block strategies: which blocks one KV group's requests hold and how that changes.

The block *count* always comes from ``reservation.reserved_blocks``; a strategy only decides what
else its kind does: attention groups share full blocks through the prefix cache; sliding-window
groups release blocks that left the window and Mamba groups those behind the live state
(``reservation.skipped_blocks``), keeping the null block in their columns; cross-attention only
grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from warmcap.core.block_pool import BlockPool, KVBlock
from warmcap.core.kv_spec import KVCacheGroup, MambaSpec
from warmcap.core.reservation import AlignState, AlignStep, align_step, skipped_blocks, stateless_columns


class GroupManager:
    """Blocks of one group for every request; no prefix caching, no skipping (Mamba state,
    cross-attention)."""

    supports_prefix_cache: ClassVar[bool] = False
    releases_blocks: ClassVar[bool] = False

    def __init__(self, group: KVCacheGroup, pool: BlockPool) -> None:
        self.group = group
        self.name = group.name
        self.spec = group.spec
        self.pool = pool
        self.req_blocks: dict[str, list[KVBlock]] = {}

    def num_held(self, req_id: str) -> int:
        """Table columns the request has in this group (null placeholders included)."""
        blocks = self.req_blocks.get(req_id)
        return len(blocks) if blocks else 0

    def null_columns(
        self,
        req_id: str,
        num_computed_tokens: int,
        num_tokens: int,
        num_committed_tokens: int,
        after_drafts: bool,
    ) -> tuple[range, ...]:
        """Columns that get the null block instead of a fresh one when they are appended (and held
        ones that go back), for a step from ``num_computed_tokens`` (all kinds of computed tokens)
        to ``num_tokens`` (drafts included), ``num_committed_tokens`` of them the request's own;
        ``after_drafts``: the request may have verified drafts before."""
        return ()

    def num_releasable(self, req_id: str, nulls: tuple[range, ...]) -> int:
        """Blocks ``release`` would return to the free queue."""
        return 0

    def release(self, req_id: str, nulls: tuple[range, ...]) -> None:
        """Put the null block in the request's held columns of ``nulls`` and free what was there."""

    def take(
        self, req_id: str, hits: Sequence[KVBlock], stop: int, nulls: tuple[range, ...] = ()
    ) -> list[int]:
        """Append prefix hits, then fresh blocks up to ``stop`` columns (the null block in columns
        of ``nulls``); returns the ids appended."""
        blocks = self.req_blocks.get(req_id)
        if blocks is None:
            blocks = self.req_blocks[req_id] = []
        start = len(blocks)
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
        if nulls:
            null = self.pool.null_block
            for col in range(len(blocks), stop):
                if any(col in r for r in nulls):
                    blocks.append(null)
                else:
                    blocks.extend(self.pool.get_new_blocks(1))
        elif stop > len(blocks):
            blocks.extend(self.pool.get_new_blocks(stop - len(blocks)))
        return [b.block_id for b in blocks[start:]]

    def free(self, req_id: str) -> None:
        """Return every block the request holds, tail first so tails are evicted first."""
        blocks = self.req_blocks.pop(req_id, None)
        if blocks:
            null = self.pool.null_block
            self.pool.free_blocks(b for b in reversed(blocks) if b is not null)


class AttentionManager(GroupManager):
    """Full attention, MLA and indexer caches: full blocks are shared through the prefix cache."""

    supports_prefix_cache = True

    def cache(self, req_id: str, block_hashes: list[int], start: int, stop: int) -> None:
        """Register the request's blocks ``[start, stop)``, which are full of real tokens."""
        blocks = self.req_blocks[req_id]
        self.pool.cache_full_blocks(self.name, blocks[start:stop], block_hashes[start:stop])


class SkippingManager(GroupManager):
    """A group whose requests stop reading leading blocks (``reservation.skipped_blocks``): those go
    back to the pool and the null block keeps their column, so the column count still equals the
    rule's while the blocks held shrink."""

    releases_blocks = True

    def __init__(self, group: KVCacheGroup, pool: BlockPool) -> None:
        super().__init__(group, pool)
        # Leading columns already released per request: each step only looks at what is new.
        self.num_released: dict[str, int] = {}

    def null_columns(
        self,
        req_id: str,
        num_computed_tokens: int,
        num_tokens: int,
        num_committed_tokens: int,
        after_drafts: bool,
    ) -> tuple[range, ...]:
        return (range(skipped_blocks(self.spec, num_computed_tokens)),)

    def _held_columns(self, req_id: str, nulls: tuple[range, ...]) -> list[int]:
        """Held columns of ``nulls`` that still hold a real block."""
        blocks = self.req_blocks.get(req_id)
        if not blocks:
            return []
        null = self.pool.null_block
        # Leading columns released before are null already: start past them.
        first = self.num_released.get(req_id, 0)
        cols: list[int] = []
        for r in nulls:
            lo = max(r.start, first)
            cols.extend(c for c in range(lo, min(r.stop, len(blocks))) if blocks[c] is not null)
        return cols

    def num_releasable(self, req_id: str, nulls: tuple[range, ...]) -> int:
        blocks = self.req_blocks.get(req_id)
        return sum(1 for c in self._held_columns(req_id, nulls) if blocks[c].ref_cnt == 1)

    def release(self, req_id: str, nulls: tuple[range, ...]) -> None:
        cols = self._held_columns(req_id, nulls)
        blocks = self.req_blocks.get(req_id)
        if not blocks:
            return
        if nulls and nulls[0].start <= 1:
            self.num_released[req_id] = max(self.num_released.get(req_id, 0), min(nulls[0].stop, len(blocks)))
        if not cols:
            return
        released = [blocks[c] for c in cols]
        null = self.pool.null_block
        for c in cols:
            blocks[c] = null
        # Tail first, as a finished request frees, so the older blocks stay cached longest.
        self.pool.free_blocks(reversed(released))

    def free(self, req_id: str) -> None:
        self.num_released.pop(req_id, None)
        super().free(req_id)


class SlidingWindowManager(SkippingManager):
    """Sliding-window attention: blocks that left the window go back."""


class MambaManager(SkippingManager):
    """Mamba state: blocks behind the live state go back (modes ``all``/``align``); in ``align`` a
    step's columns that never hold a state stay null (``reservation.stateless_columns``).

    A target model's ``align`` groups use :class:`AlignMambaManager` (the reference engine's
    layout); this rule stays for a drafter's Mamba groups, whose passes place states by the
    committed tokens (``runner_v2/mamba_draft_state.py``) and which the reference engine has no
    counterpart for (its draft models have no Mamba layers)."""

    def null_columns(
        self,
        req_id: str,
        num_computed_tokens: int,
        num_tokens: int,
        num_committed_tokens: int,
        after_drafts: bool,
    ) -> tuple[range, ...]:
        # Column 0 goes back too, as in the reference engine: the runner tells a row's request by
        # its newest block (runner_v2/mamba_state.py identity_blocks), which is always held.
        skipped = range(skipped_blocks(self.spec, num_computed_tokens))
        # NOTE: after a verify step the live state is the state after the last accepted draft,
        # any of the 1 + k columns from the last computed token's (runner_v2/mamba_state.py).
        live = 1 + self.spec.num_speculative_blocks if after_drafts else 1
        gap = stateless_columns(self.spec, num_computed_tokens, num_committed_tokens, num_live_columns=live)
        return skipped, gap


class AlignMambaManager(GroupManager):
    """A target model's Mamba group in cache mode ``align``: the reference engine's layout
    (``reservation.align_step``). The running state and the draft states live in the last
    ``1 + k`` columns; one earlier state column is kept until the computed tokens leave it behind;
    every other column is null. Its block counts equal the reference engine's call by call."""

    releases_blocks: ClassVar[bool] = True

    def __init__(self, group: KVCacheGroup, pool: BlockPool) -> None:
        super().__init__(group, pool)
        self.states: dict[str, AlignState] = {}
        # The plan of the call in progress, applied by ``take`` once the call can be served.
        self._pending: dict[str, AlignStep] = {}

    def null_columns(
        self,
        req_id: str,
        num_computed_tokens: int,
        num_tokens: int,
        num_committed_tokens: int,
        after_drafts: bool,
    ) -> tuple[range, ...]:
        assert isinstance(self.spec, MambaSpec)
        state = self.states.get(req_id) or AlignState()
        plan = align_step(
            self.spec, state, self.num_held(req_id), num_computed_tokens, num_tokens, num_committed_tokens
        )
        self._pending[req_id] = plan
        return tuple(range(c, c + 1) for c in plan.released) + plan.nulls

    def _held_columns(self, req_id: str, nulls: tuple[range, ...]) -> list[int]:
        blocks = self.req_blocks.get(req_id)
        if not blocks:
            return []
        null = self.pool.null_block
        return [c for r in nulls for c in r if c < len(blocks) and blocks[c] is not null]

    def num_releasable(self, req_id: str, nulls: tuple[range, ...]) -> int:
        blocks = self.req_blocks.get(req_id)
        return sum(1 for c in self._held_columns(req_id, nulls) if blocks[c].ref_cnt == 1)

    def release(self, req_id: str, nulls: tuple[range, ...]) -> None:
        cols = self._held_columns(req_id, nulls)
        if not cols:
            return
        blocks = self.req_blocks[req_id]
        released = [blocks[c] for c in cols]
        null = self.pool.null_block
        for c in cols:
            blocks[c] = null
        self.pool.free_blocks(reversed(released))

    def take(
        self, req_id: str, hits: Sequence[KVBlock], stop: int, nulls: tuple[range, ...] = ()
    ) -> list[int]:
        ids = super().take(req_id, hits, stop, nulls)
        plan = self._pending.pop(req_id, None)
        if plan is not None:
            self.states[req_id] = plan.state
        return ids

    def free(self, req_id: str) -> None:
        self.states.pop(req_id, None)
        self._pending.pop(req_id, None)
        super().free(req_id)


def manager_class(group: KVCacheGroup) -> type[GroupManager]:
    """The strategy of ``group``: by its spec's kind, and a target model's Mamba ``align`` group
    by the reference engine's layout (:class:`AlignMambaManager`)."""
    spec = group.spec
    if isinstance(spec, MambaSpec) and spec.cache_mode == "align" and not group.is_drafter:
        return AlignMambaManager
    return MANAGER_BY_KIND[spec.kind]


MANAGER_BY_KIND: dict[str, type[GroupManager]] = {
    "full": AttentionManager,
    "mla": AttentionManager,
    "indexer": AttentionManager,
    "sliding_window": SlidingWindowManager,
    "mamba": MambaManager,
    "cross_attention": GroupManager,
}
