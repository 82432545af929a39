"""The KV cache manager: one block pool, one strategy per KV group, allocation by the one rule."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from warmcap.core.block_pool import BlockPool
from warmcap.core.group_managers import MANAGER_BY_KIND, AttentionManager, GroupManager, manager_class
from warmcap.core.hashing import extend_block_hashes
from warmcap.core.reservation import block_of, blocks_per_request, reserved_blocks
from warmcap.errors import ConfigError

logger = logging.getLogger(__name__)

# Distinct (tokens, lookahead, encoder tokens) keys kept before the memo starts over; each entry is
# small, and a key space that large only comes from many distinct encoder lengths.
_MAX_MEMO = 1 << 16

if TYPE_CHECKING:
    from warmcap.core.block_pool import KVBlock
    from warmcap.core.kv_spec import KVCacheGroup
    from warmcap.core.request import Request


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """Pool occupancy and prefix-cache effectiveness."""

    num_blocks: int
    num_free_blocks: int
    usage: float
    prefix_cache_queries: int  # prompt tokens looked up at admission
    prefix_cache_hits: int  # of which were found in the cache

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(slots=True, eq=False)
class _RequestState:
    """What the manager remembers about a request between its steps."""

    # Block counts per group that its holdings are known to cover (held >= counts in each group).
    counts: tuple[int, ...]
    # Leading blocks registered in the prefix cache, and the token count that fills the next one.
    num_cached: int
    cache_at: int


class NoNewBlocks(dict):
    """The result of an allocation that needs no block: an empty list per KV group, one instance
    shared by every such request of every step (so a step of hundreds of running requests allocates
    nothing). Read-only: every mutator raises. Unlike ``types.MappingProxyType`` it pickles (as
    itself), which a tensor-parallel broadcast of a step's scheduler output needs."""

    __slots__ = ()

    def __init__(self, group_names: Iterable[str]) -> None:
        super().__init__((n, []) for n in group_names)

    def __reduce__(self) -> tuple[type[NoNewBlocks], tuple[tuple[str, ...]]]:
        return NoNewBlocks, (tuple(self),)

    def _read_only(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("the shared 'no new blocks' result is read-only; copy it to change it")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only


class KVCacheManager:
    """Allocates every KV group's blocks for every request from one shared pool.

    Token layout of a request at one step: computed | new computed (prefix hits) | external (KV
    loaded from a remote prefill) | new (scheduled) | lookahead (drafter writes). Each group holds
    ``reserved_blocks(spec, computed + new computed + external + new, L, M)`` blocks afterwards,
    or more when it already held more (drafts were rejected).
    """

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        num_blocks: int,
        *,
        max_model_len: int,
        enable_caching: bool | None = None,
        max_encoder_len: int = 0,
    ) -> None:
        if not groups:
            raise ConfigError("a KV cache manager needs at least one KV cache group; got none")
        self.groups = list(groups)
        self.max_model_len = max_model_len
        self.max_encoder_len = max_encoder_len
        unknown = sorted({g.spec.kind for g in self.groups} - MANAGER_BY_KIND.keys())
        if unknown:
            raise ConfigError(
                f"no block strategy for KV spec kind(s) {unknown}: use {sorted(MANAGER_BY_KIND)}"
            )
        managers = [manager_class(g) for g in self.groups]
        block_sizes = {g.spec.block_size for g in self.groups}
        # Prefix hits must hold in every group at once: only when all groups can share blocks
        # and one hash chain (one block size) describes them all.
        can_cache = all(m.supports_prefix_cache for m in managers) and len(block_sizes) == 1
        if enable_caching and not can_cache:
            # Asked for explicitly: a silent downgrade would hide that every prompt is recomputed.
            raise ConfigError(
                f"prefix caching was asked for but cannot serve hits here: {_caching_off_reason(self.groups)}; "
                "turn it off (enable_prefix_caching=False) or leave it unset to let warmcap decide"
            )
        self.enable_caching = bool(enable_caching is not False and can_cache)
        #: Why prefix caching is off although it was left to warmcap ("" when on or turned off).
        self.caching_off_reason = (
            "" if can_cache or enable_caching is False else _caching_off_reason(self.groups)
        )
        if self.caching_off_reason:
            logger.info("prefix caching is off: %s", self.caching_off_reason)
        self.pool = BlockPool(num_blocks, enable_caching=self.enable_caching)
        self.managers: list[GroupManager] = [
            cls(g, self.pool) for cls, g in zip(managers, self.groups, strict=True)
        ]
        self._releasing = [m for m in self.managers if m.releases_blocks]
        self._group_names = [g.name for g in self.groups]
        # NOTE: shared by every step of every request that needs no block, so the hundreds of
        # running requests of a step allocate nothing; read-only, and its lists must stay empty.
        self._no_new_blocks: Mapping[str, list[int]] = NoNewBlocks(self._group_names)
        self._hash_spec = self.groups[0].spec
        self._hash_block_size = self._hash_spec.block_size
        # NOTE: a drafter's KV at a block's last position can depend on the next block's first
        # token (EAGLE shifts tokens by one), which the block hash does not cover: such hits drop
        # their last block so the drafter recomputes it.
        self._trim_last_hit = any(g.is_drafter for g in self.groups)
        self._caching = [m for m in self.managers if isinstance(m, AttentionManager)]
        self._state: dict[str, _RequestState] = {}
        self._counts: dict[tuple[int, int, int], tuple[int, ...]] = {}
        self._interned: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._prefix_queries = 0
        self._prefix_hits = 0

    # ----------------------------------------------------------------------------------- queries

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            usage=self.pool.usage,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
        )

    def blocks_needed(
        self, num_tokens: int, *, num_lookahead_tokens: int, num_encoder_tokens: int = 0
    ) -> int:
        """Blocks a fresh request with ``num_tokens`` in flight takes, summed over all groups."""
        counts = blocks_per_request(
            self.groups,
            num_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            max_model_len=self.max_model_len,
            max_encoder_len=num_encoder_tokens or self.max_encoder_len,
        )
        return sum(counts.values())

    def get_block_ids(self, request_id: str) -> dict[str, list[int]]:
        """Every column of the request's block table per group (0 marks a released column)."""
        return {m.name: [b.block_id for b in m.req_blocks.get(request_id, ())] for m in self.managers}

    def num_held_blocks(self, request_id: str) -> dict[str, int]:
        """Block-table columns the request has per group (null placeholders included)."""
        return {m.name: m.num_held(request_id) for m in self.managers}

    # ------------------------------------------------------------------------------ prefix cache

    def get_computed_blocks(self, request: Request) -> tuple[dict[str, list[int]], int]:
        """Longest cached prefix of the request in every group: (block ids per group, tokens).

        Only full blocks count, and never the block holding the last token, so at least one token
        is left to compute (its logits give the next token). A request asking for prompt logprobs
        reads no cached prefix (as vLLM's V1 engine): a cached position has no hidden state to take
        its logprob from. Its own blocks are still cached for later requests.
        """
        hits: dict[str, list[int]] = {m.name: [] for m in self.managers}
        if (
            not self.enable_caching
            or request.num_tokens < 2
            or request.sampling_params.prompt_logprobs is not None
        ):
            return hits, 0
        self._update_hashes(request)
        limit = block_of(self._hash_spec, request.num_tokens - 1)
        pool = self.pool
        num_hit = 0
        for block_hash in request.block_hashes[:limit]:
            found = [pool.get_cached_block(block_hash, m.name) for m in self.managers]
            if any(b is None for b in found):
                break
            for m, block in zip(self.managers, found, strict=True):
                hits[m.name].append(block.block_id)
            num_hit += 1
        if self._trim_last_hit and num_hit:
            num_hit -= 1
            for ids in hits.values():
                ids.pop()
        return hits, num_hit * self._hash_block_size

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many blocks lost their hash."""
        return self.pool.reset_prefix_cache()

    # -------------------------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        *,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: dict[str, list[int]] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        num_encoder_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> dict[str, list[int]] | None:
        """Grow the request's blocks to the rule's count; returns the ids appended per group,
        or None when the pool is short, in which case nothing changed.

        ``delay_cache_blocks``: the blocks' KV is still being loaded from outside, so none of them
        may enter the prefix cache yet; they are cached by the request's first call after the load.
        """
        # NOTE: this runs for every running request every step. The common case, a step that
        # needs no new block, must stay free of per-group work: keep slow paths in helpers.
        req_id = request.request_id
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = num_computed + num_external_computed_tokens + num_new_tokens
        key = (num_tokens, num_lookahead_tokens, num_encoder_tokens or request.num_encoder_tokens)
        counts = self._counts.get(key) or self._reserve(key)
        state = self._state.get(req_id)
        # Counts are interned, so identity means the holdings already cover the rule's count.
        if state is None or counts is not state.counts or new_computed_blocks or self._releasing:
            new_ids = self._grow(
                request,
                state,
                counts,
                num_computed + num_external_computed_tokens,
                num_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
            )
            if new_ids is None:
                return None
            state = self._state[req_id]
        else:
            new_ids = {}
            for name in self._group_names:
                new_ids[name] = []
        if num_tokens >= state.cache_at and self.enable_caching and not delay_cache_blocks:
            self._cache_written_blocks(request, state, num_tokens)
        return new_ids

    def allocate_running(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int
    ) -> Mapping[str, list[int]] | None:
        """``allocate_slots`` for a request that is already running (no prefix hits, no external
        load), as the scheduler asks for every running request every step.

        A step whose tokens stay within the blocks held and fill no block is answered here without
        the general path's keyword handling; any other step takes ``allocate_slots``.
        """
        num_tokens = request.num_computed_tokens + num_new_tokens
        counts = self._counts.get((num_tokens, num_lookahead_tokens, request.num_encoder_tokens))
        state = self._state.get(request.request_id)
        if state is None or counts is not state.counts or self._releasing:
            return self.allocate_slots(request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
        if num_tokens >= state.cache_at and self.enable_caching:
            self._cache_written_blocks(request, state, num_tokens)
        return self._no_new_blocks

    def free(self, request: Request) -> None:
        """Return every block the request holds (released placeholders excluded)."""
        for m in self.managers:
            m.free(request.request_id)
        self._state.pop(request.request_id, None)

    # ---------------------------------------------------------------------------------- internal

    def _reserve(self, key: tuple[int, int, int]) -> tuple[int, ...]:
        """The rule's block count per group for (tokens, lookahead, encoder tokens), memoized:
        a pure function of the key, asked for every running request every step."""
        num_tokens, num_lookahead_tokens, num_encoder_tokens = key
        counts = tuple(
            # Cross-attention groups size by the request's encoder length; others ignore it.
            reserved_blocks(
                m.spec,
                num_tokens,
                num_lookahead_tokens=num_lookahead_tokens,
                max_model_len=self.max_model_len,
                max_encoder_len=num_encoder_tokens,
            )
            for m in self.managers
        )
        if len(self._counts) >= _MAX_MEMO:
            self._counts.clear()
            self._interned.clear()
        # Equal counts share one tuple, so a request's step compares them by identity.
        counts = self._interned.setdefault(counts, counts)
        self._counts[key] = counts
        return counts

    def _grow(
        self,
        request: Request,
        state: _RequestState | None,
        counts: tuple[int, ...],
        num_computed: int,
        num_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: dict[str, list[int]] | None,
    ) -> dict[str, list[int]] | None:
        """Take prefix hits and fresh blocks up to ``counts``; returns the ids appended per group,
        or None when the pool is short, in which case nothing changed.

        NOTE: the reference engine releases skipped blocks even when the allocation then fails;
        here a failed call changes nothing (the scheduler retries after preempting), and the next
        successful call releases them, so block counts after every successful call agree."""
        req_id = request.request_id
        hits = self._hit_blocks(new_computed_blocks) if new_computed_blocks else None
        num_real = len(request.prompt_token_ids) + len(request.output_token_ids)
        committed = num_tokens if num_tokens < num_real else num_real
        after_drafts = num_computed > len(request.prompt_token_ids)
        plans: list[tuple[int, tuple[range, ...]]] = []
        need = 0
        for i, m in enumerate(self.managers):
            held = m.req_blocks.get(req_id)
            start = (len(held) if held else 0) + (len(hits[i]) if hits else 0)
            stop = counts[i]
            nulls = (
                m.null_columns(req_id, num_computed, num_tokens, committed, after_drafts)
                if m.releases_blocks
                else ()
            )
            plans.append((stop, nulls))
            if stop > start:
                need += stop - start
                for r in nulls:
                    need -= len(range(max(start, r.start), min(stop, r.stop)))
        if hits:
            # A hit that is free right now leaves the free queue when touched.
            need += sum(1 for group_hits in hits for b in group_hits if b.ref_cnt == 0)
        if need:
            free_now = self.pool.num_free_blocks
            for i, m in enumerate(self.managers):
                if plans[i][1]:
                    free_now += m.num_releasable(req_id, plans[i][1])
            if need > free_now:
                return None
        for i, m in enumerate(self.managers):
            if plans[i][1]:
                m.release(req_id, plans[i][1])

        if state is None:
            num_cached = len(hits[0]) if hits else 0
            state = _RequestState(counts, num_cached, (num_cached + 1) * self._hash_block_size)
            self._state[req_id] = state
            self._prefix_queries += request.num_tokens
            self._prefix_hits += num_new_computed_tokens
        new_ids: dict[str, list[int]] = {}
        for i, m in enumerate(self.managers):
            stop, nulls = plans[i]
            new_ids[m.name] = m.take(req_id, hits[i] if hits else (), stop, nulls)
        # Every group now holds at least ``counts``: later steps asking for the same counts skip
        # this method.
        state.counts = counts
        return new_ids

    def _hit_blocks(self, new_computed_blocks: dict[str, list[int]]) -> list[list[KVBlock]]:
        blocks = self.pool.blocks
        return [[blocks[i] for i in new_computed_blocks.get(m.name, ())] for m in self.managers]

    def _update_hashes(self, request: Request) -> None:
        extend_block_hashes(
            request.block_hashes, request.prompt_token_ids, request.output_token_ids, self._hash_block_size
        )

    def _cache_written_blocks(self, request: Request, state: _RequestState, num_tokens: int) -> None:
        """Register the blocks full of the request's own tokens whose KV is written once
        ``num_tokens`` are computed: never the lookahead region, never draft tokens (which are not
        in the request's tokens)."""
        num_real = len(request.prompt_token_ids) + len(request.output_token_ids)
        end = num_tokens if num_tokens < num_real else num_real
        if end >= state.cache_at:
            self._cache_full_blocks(request, state, end)

    def _cache_full_blocks(self, request: Request, state: _RequestState, end: int) -> None:
        """Register the request's blocks that are full of tokens ``[0, end)`` and not cached yet."""
        num_full = block_of(self._hash_spec, end)
        block_hashes = request.block_hashes
        extend_block_hashes(
            block_hashes, request.prompt_token_ids, request.output_token_ids, self._hash_block_size
        )
        for m in self._caching:
            m.cache(request.request_id, block_hashes, state.num_cached, num_full)
        state.num_cached = num_full
        state.cache_at = (num_full + 1) * self._hash_block_size


def _caching_off_reason(groups: Sequence[KVCacheGroup]) -> str:
    """Why these groups cannot share prefix-cache hits, naming the group (and Mamba cache mode)."""
    for g in groups:
        mode = getattr(g.spec, "cache_mode", None)
        if mode == "none":
            return (
                f"Mamba group {g.name!r} in cache mode 'none' keeps one state per request, none per "
                "block (as the reference engine, which disables prefix caching there too)"
            )
        if mode is not None:
            return (
                f"Mamba group {g.name!r} in cache mode {mode!r}: warmcap does not share Mamba states "
                "through the prefix cache yet, so every prompt is computed in full"
            )
        if not MANAGER_BY_KIND[g.spec.kind].supports_prefix_cache:
            return f"group {g.name!r} ({g.spec.kind}) has no prefix-cache support"
    return "the KV groups have different block sizes, so one hash chain cannot describe them all"
