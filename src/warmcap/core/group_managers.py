"""Per-group block strategies: which blocks one KV group's requests hold and how that changes.

The block *count* always comes from ``reservation.reserved_blocks``; a strategy only decides what
else its kind does: attention groups share full blocks through the prefix cache, sliding-window
groups release blocks that left the window; Mamba state and cross-attention only grow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from warmcap.core.block_pool import BlockPool, KVBlock
from warmcap.core.kv_spec import KVCacheGroup
from warmcap.core.reservation import skipped_blocks


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

    def num_releasable(self, req_id: str, num_computed_tokens: int) -> int:
        """Blocks ``release_skipped`` would return to the free queue."""
        return 0

    def release_skipped(self, req_id: str, num_computed_tokens: int) -> None:
        """Free blocks the request no longer reads (sliding window only)."""

    def take(self, req_id: str, hits: Sequence[KVBlock], num_new: int) -> list[int]:
        """Append prefix hits then ``num_new`` fresh blocks; returns the ids appended."""
        blocks = self.req_blocks.get(req_id)
        if blocks is None:
            blocks = self.req_blocks[req_id] = []
        start = len(blocks)
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
        if num_new:
            blocks.extend(self.pool.get_new_blocks(num_new))
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


class SlidingWindowManager(GroupManager):
    """Sliding-window attention: blocks that left the window go back, the null block keeps
    their column so the block count still equals the rule's."""

    releases_blocks = True

    def __init__(self, group: KVCacheGroup, pool: BlockPool) -> None:
        super().__init__(group, pool)
        # Leading columns already released per request: each step only looks at what is new.
        self.num_released: dict[str, int] = {}

    def num_releasable(self, req_id: str, num_computed_tokens: int) -> int:
        blocks = self.req_blocks.get(req_id)
        if not blocks:
            return 0
        first = self.num_released.get(req_id, 0)
        skip = skipped_blocks(self.spec, num_computed_tokens)
        return sum(1 for b in blocks[first:skip] if b.ref_cnt == 1)

    def release_skipped(self, req_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_blocks.get(req_id)
        if not blocks:
            return
        first = self.num_released.get(req_id, 0)
        skip = min(skipped_blocks(self.spec, num_computed_tokens), len(blocks))
        if skip <= first:
            return
        released = blocks[first:skip]
        blocks[first:skip] = [self.pool.null_block] * (skip - first)
        self.num_released[req_id] = skip
        self.pool.free_blocks(reversed(released))

    def free(self, req_id: str) -> None:
        self.num_released.pop(req_id, None)
        super().free(req_id)


MANAGER_BY_KIND: dict[str, type[GroupManager]] = {
    "full": AttentionManager,
    "mla": AttentionManager,
    "indexer": AttentionManager,
    "sliding_window": SlidingWindowManager,
    "mamba": GroupManager,
    "cross_attention": GroupManager,
}
