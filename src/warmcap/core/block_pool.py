"""The block pool: every KV block id, its reference count, the LRU free queue and the prefix cache.

Block 0 is the null block: a placeholder for table columns a request does not hold (sliding-window
blocks that fell out of the window). It is never handed out and never freed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from warmcap.errors import CapacityError

NULL_BLOCK_ID = 0

# A cached block is keyed by (KV group name, chained block hash): groups never share entries.
BlockHashKey = tuple[str, int]


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block id of the pool; identity matters, so blocks compare by object."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHashKey | None = None


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """Everything observable about a pool's state, as a comparable value."""

    free_order: tuple[int, ...]
    ref_counts: tuple[int, ...]
    cached: tuple[tuple[str, int, int], ...]  # (group, hash, block id), sorted

    def differences(self, other: PoolSnapshot) -> list[str]:
        """Human-readable differences between two snapshots (empty when equal)."""
        out: list[str] = []
        if self.free_order != other.free_order:
            out.append(f"free queue differs ({len(self.free_order)} vs {len(other.free_order)} free blocks)")
        changed = [
            i for i, (a, b) in enumerate(zip(self.ref_counts, other.ref_counts, strict=False)) if a != b
        ]
        if changed or len(self.ref_counts) != len(other.ref_counts):
            out.append(f"ref counts differ at blocks {changed[:8]}")
        if self.cached != other.cached:
            out.append(f"prefix cache differs ({len(self.cached)} vs {len(other.cached)} cached blocks)")
        return out


class BlockPool:
    """Fixed set of ``num_blocks`` block ids shared by every KV group.

    Free blocks wait in an LRU queue: new blocks come from its head, freed blocks go to its tail,
    except blocks without a prefix hash, which go to the head because nothing can reuse them.
    A cached block stays findable while it is free and loses its hash only when it is evicted,
    i.e. taken from the free queue for a new owner.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise CapacityError(
                f"a block pool needs at least 2 blocks (block 0 is the null block); got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[BlockHashKey, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``get_new_blocks`` can hand out (free cached blocks included)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (null block excluded) held by requests."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, evicting their hashes."""
        if num_blocks > len(self._free):
            raise CapacityError(
                f"asked for {num_blocks} KV blocks but only {len(self._free)} are free; "
                "check num_free_blocks before allocating"
            )
        out: list[KVBlock] = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (prefix-cache hits); free ones leave the queue."""
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID:
                raise AssertionError("the null block is never shared")
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in order; a block at zero joins the free queue."""
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID:
                raise AssertionError("the null block is never freed")
            if block.ref_cnt <= 0:
                raise AssertionError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_full_blocks(self, group: str, blocks: Sequence[KVBlock], block_hashes: Sequence[int]) -> None:
        """Register full blocks under their chained hashes so later requests can share them.

        A block already cached keeps its hash; a hash already owned by another block is skipped
        (two requests computed the same prefix at once) and this block stays private.
        """
        if not self.enable_caching:
            return
        if len(blocks) != len(block_hashes):
            raise ValueError(f"{len(blocks)} blocks but {len(block_hashes)} hashes to cache them under")
        cached = self._cached
        for i, block in enumerate(blocks):
            key = (group, block_hashes[i])
            if block.block_hash is not None or key in cached:
                continue
            block.block_hash = key
            cached[key] = block

    def get_cached_block(self, block_hash: int, group: str) -> KVBlock | None:
        """The block caching ``block_hash`` in ``group``, held or free, or None."""
        return self._cached.get((group, block_hash))

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash; blocks keep their owners. Returns how many were dropped."""
        dropped = len(self._cached)
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return dropped

    def snapshot(self) -> PoolSnapshot:
        """Free-queue order, reference counts and cached hashes, for before/after comparisons."""
        return PoolSnapshot(
            free_order=tuple(self._free),
            ref_counts=tuple(b.ref_cnt for b in self.blocks),
            cached=tuple(sorted((g, h, b.block_id) for (g, h), b in self._cached.items())),
        )
