"""A target model's Mamba ``align`` group against a model of vLLM's ``MambaManager`` (cache mode
``align``), call by call, over random block sizes, speculative blocks, lookahead and step sizes.

The model below follows vLLM's mechanism as its source describes it
(``vllm/v1/core/single_type_kv_cache_manager.py`` ``MambaManager`` and the base
``SingleTypeKVCacheManager``; ``kv_cache_manager.py`` ``KVCacheManager.allocate_slots``), block
identities included, with ``None`` for the null block:

- ``allocate_slots`` first calls ``remove_skipped_blocks(total_computed)``: Mamba skips
  ``total_computed - 1`` tokens, so the columns wholly before that token's block become null,
  walking back from it and stopping at the first null column; then the previous running state
  (``last_state_block_idx``) is freed once it lies before column ``cdiv(total_computed, bs) - 1``.
- A new request whose KV is partly loaded from outside (a P/D consumer) gets null columns for the
  skipped tokens and one block for the loaded state (``allocate_new_computed_blocks``).
- ``allocate_new_blocks`` ignores the lookahead and sizes the table to
  ``cdiv(computed + new, bs) + k`` columns (drafts included). On growth it records the previous
  running state (the column ``1 + k`` from the end; for a new request with loaded blocks, the
  last one), pads with null columns up to the new running state's column, *moves* the previous
  speculative blocks that now fall before it to the end (their columns become null) and takes
  fresh blocks for the rest; a first allocation takes ``1 + k`` blocks.

vLLM asserts that a table never has to shrink (it schedules a constant number of drafts); warmcap
also runs drafters that propose fewer, and then both the model and warmcap keep the table as is.

warmcap's runner table only appends, so it cannot move a block to another column: it frees the
columns vLLM moves from and takes fresh blocks where vLLM moves them to, and when the live state
(after accepted drafts) sits in one of those columns it keeps that column in place of the previous
running state. So the *counts* are vLLM's after every call, the column count and column 0's
null-ness too, while the columns of the kept state may differ; and the columns the runner reads
(the live state) and writes (the running and draft states, the last ``1 + k``) always hold blocks.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.core.kv_cache_manager import KVCacheManager
from warmcap.core.kv_spec import KVCacheGroup, MambaSpec
from warmcap.core.request import Request


class VllmAlignManager:
    """vLLM's ``MambaManager`` in cache mode ``align`` for one request, block ids included."""

    def __init__(self, block_size: int, num_speculative_blocks: int) -> None:
        self.bs = block_size
        self.k = num_speculative_blocks
        self.table: list[int | None] = []
        self.allocated = False  # vLLM's _allocated_block_reqs
        self.last_state: int | None = None  # vLLM's last_state_block_idx
        self._next_id = 1

    def _fresh(self, n: int) -> list[int | None]:
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        return ids

    def _ceil(self, n: int) -> int:
        return (n + self.bs - 1) // self.bs

    def allocate(self, computed: int, external: int, new: int) -> None:
        total = computed + external
        # remove_skipped_blocks: Mamba skips every token but the last computed one
        skipped_tokens = total - 1
        if skipped_tokens > 0:
            for i in reversed(range(min(skipped_tokens // self.bs, len(self.table)))):
                if self.table[i] is None:
                    break
                self.table[i] = None
        last = self.last_state
        if last is not None and last < self._ceil(total) - 1 and self.table[last] is not None:
            self.table[last] = None
        # allocate_new_computed_blocks: a new request's loaded tokens
        if not self.allocated and not self.table and external:
            self.table += [None] * ((total - 1) // self.bs)
            self.table += self._fresh(self._ceil(total) - len(self.table))
        # allocate_new_blocks: lookahead ignored, drafts included
        required = self._ceil(total + new) + self.k
        if required <= len(self.table):
            return
        prev = len(self.table)
        if self.allocated:
            self.last_state = prev - 1 - self.k
        elif prev:
            self.last_state = prev - 1
        state_col = required - 1 - self.k
        self.table += [None] * max(0, state_col - prev)
        if self.allocated:
            for i in range(prev - self.k, prev):
                if i >= state_col:
                    break
                self.table.append(self.table[i])
                self.table[i] = None
        self.table += self._fresh(required - len(self.table))
        self.allocated = True

    @property
    def num_real(self) -> int:
        return sum(b is not None for b in self.table)


@st.composite
def trajectories(draw: st.DrawFn):
    bs = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    k = draw(st.integers(0, 3))
    lookahead = draw(st.integers(0, 3))
    prompt_len = draw(st.integers(1, 40))
    external = draw(st.sampled_from([0, 0, 0, *range(1, prompt_len)])) if prompt_len > 1 else 0
    chunks = draw(st.lists(st.integers(1, 3 * bs + 2), min_size=1, max_size=6))
    fixed = draw(st.booleans())  # a drafter that always proposes k (MTP) or one that varies (ngram)
    decodes = draw(
        st.lists(
            st.integers(0, k).flatmap(lambda d: st.tuples(st.just(d), st.integers(0, d))),
            max_size=10,
        )
    )
    if fixed:
        decodes = [(k, min(a, k)) for _, a in decodes]
    return bs, k, lookahead, prompt_len, external, chunks, decodes


@settings(max_examples=300, deadline=None)
@given(trajectories())
def test_align_blocks_equal_vllms_call_by_call(case):
    bs, k, lookahead, prompt_len, external, chunks, decodes = case
    spec = MambaSpec(bs, state_shapes=((4, 8),), cache_mode="align", num_speculative_blocks=k)
    num_blocks = 512
    kv = KVCacheManager([KVCacheGroup("m", spec)], num_blocks, max_model_len=4096, enable_caching=False)
    ref = VllmAlignManager(bs, k)
    req = Request("r", list(range(prompt_len)))

    # the prompt in chunks (the first after any loaded tokens), then decode steps: the sampled
    # token plus d drafts of which a are accepted
    steps: list[tuple[int, int, int]] = []  # (scheduled, drafts, accepted)
    done = external
    for chunk in chunks:
        if done < prompt_len:
            steps.append((min(chunk, prompt_len - done), 0, 0))
            done += steps[-1][0]
    if done == prompt_len:
        steps += [(1 + d, d, a) for d, a in decodes]

    live: int | None = None  # the column warmcap's runner reads the live state from
    for i, (scheduled, drafts, accepted) in enumerate(steps):
        loaded = external if i == 0 else 0
        computed = req.num_computed_tokens
        new = kv.allocate_slots(
            req, scheduled, num_lookahead_tokens=lookahead, num_external_computed_tokens=loaded
        )
        assert new is not None
        ref.allocate(computed, loaded, scheduled)

        ids = kv.get_block_ids("r")["m"]
        where = f"step {i} (c={computed}+{loaded}, s={scheduled}, d={drafts}): {ids} vs vLLM {ref.table}"
        assert len(ids) == len(ref.table), where
        assert sum(b != 0 for b in ids) == ref.num_real, where
        assert (ids[0] == 0) == (ref.table[0] is None), where
        assert kv.pool.num_free_blocks == num_blocks - 1 - ref.num_real, where
        # the runner writes the running and draft states to the last 1 + k columns and reads the
        # live state where the previous step left it
        anchor = len(ids) - 1 - k
        assert all(b != 0 for b in ids[anchor:]), where
        if live is not None:
            assert ids[live] != 0, f"live state column {live} released: {where}"

        req.num_computed_tokens = computed + loaded + scheduled - drafts + accepted
        if req.num_computed_tokens >= prompt_len:  # sampled: the accepted drafts and one token
            req.output_token_ids.extend([7] * (accepted + 1))
        live = anchor + accepted
    kv.free(req)
    assert kv.pool.num_free_blocks == num_blocks - 1
