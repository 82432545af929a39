"""Where a request's Mamba state lives in its Mamba group's block table, per cache mode.

A Mamba layer keeps one whole state (conv window + SSM state) per block id; its tensor is
``[num_blocks + 1, conv_elems + ssm_elems]`` (last row: the PAD sink), split by :func:`state_views`.
A step reads the request's live state from one column and writes the state reached after chosen
tokens into other columns. With ``n = c + s - d`` (computed + scheduled tokens, minus the ``d``
draft tokens of a verify step) the columns are:

- ``none``: states live in columns ``0 .. k`` (vLLM sizes this group's block to ``max_model_len``,
  so a request holds ``1 + k`` blocks). A step writes the state after its last committed token
  to column 0 and the state after draft j to column j.
- ``align`` / ``all``: the anchor is ``block_of(n - 1)``, the block of the last committed token;
  the state after it goes there and the state after draft j to ``anchor + j`` (vLLM gathers
  ``1 + k`` consecutive columns from the last block). ``all`` also writes the state at every block
  boundary a step crosses (position ``p`` with ``(p + 1) % block_size == 0``) into ``block_of(p)``,
  so prefix-cache hits on whole blocks find their state; ``align`` leaves that to chunking.
- After verification accepts ``a`` of the ``1 + d`` verified positions (``a >= 1``) the live state
  is column ``anchor + a - 1``; the next step reads it before it writes anything.

NOTE: boundaries crossed only by draft tokens are not written in ``all`` mode: a draft's state may
be rolled back, so a prefix-cache entry must never trust it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import torch

from warmcap.core.kv_spec import MambaSpec
from warmcap.core.reservation import block_of
from warmcap.runner_v2.attention.base import AttentionMetadata

NO_BLOCK = -1


@dataclass(slots=True)
class MambaMetadata(AttentionMetadata):
    """Attention metadata of a Mamba group plus where each row's state is read and written.

    - ``read_blocks`` int64 [R]: the block holding the state a row starts from; -1: zero state
      (a new request, or a padded row).
    - ``write_blocks`` int64 [T]: the block receiving the state reached after token t; -1: none.
    """

    read_blocks: torch.Tensor | None = None
    write_blocks: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class StatePlan:
    """One request's state traffic in one step: the column read (None: zero state) and
    ``(token index within the step, column)`` pairs written."""

    read_column: int | None
    writes: tuple[tuple[int, int], ...]


def anchor_column(spec: MambaSpec, num_committed_tokens: int) -> int:
    """Column of the state after the last committed token (``num_committed_tokens >= 1``)."""
    if spec.cache_mode == "none":
        return 0
    return block_of(spec, num_committed_tokens - 1)


def accepted_column(spec: MambaSpec, num_committed_tokens: int, num_accepted: int) -> int:
    """The live column after a step whose last committed token is number ``num_committed_tokens``
    and whose verification accepted ``num_accepted`` (>= 1) of its ``1 + d`` verified positions."""
    if num_accepted < 1 or num_accepted > 1 + spec.num_speculative_blocks:
        raise ValueError(
            f"num_accepted must be in [1, {1 + spec.num_speculative_blocks}]; got {num_accepted}"
        )
    return anchor_column(spec, num_committed_tokens) + num_accepted - 1


def prefix_column(spec: MambaSpec, num_cached_tokens: int) -> int | None:
    """Where a prefix-cache hit of ``num_cached_tokens`` (whole blocks) finds its state; None in
    mode ``none`` (no state is kept per block) or for an empty hit."""
    if spec.cache_mode == "none" or num_cached_tokens == 0:
        return None
    return block_of(spec, num_cached_tokens - 1)


def plan_state(
    spec: MambaSpec,
    *,
    num_computed_tokens: int,
    num_scheduled_tokens: int,
    num_spec_tokens: int,
    live_column: int | None,
) -> StatePlan:
    """The reads and writes of one request in one step (see the module docstring)."""
    c, s, d = num_computed_tokens, num_scheduled_tokens, num_spec_tokens
    if not 0 <= d < s or d > spec.num_speculative_blocks:
        raise ValueError(
            f"num_spec_tokens must be in [0, min(num_scheduled_tokens - 1, {spec.num_speculative_blocks})]; "
            f"got {d} with {s} scheduled"
        )
    if c > 0 and live_column is None:
        raise ValueError(f"a request with {c} computed tokens needs the column of its live state")
    committed = c + s - d
    writes: dict[int, int] = {}
    if spec.cache_mode == "all":
        for i in range(s - d):
            if (c + i + 1) % spec.block_size == 0:
                writes[i] = block_of(spec, c + i)
    anchor = anchor_column(spec, committed)
    for j in range(1 + d):
        writes[s - d - 1 + j] = anchor + j
    return StatePlan(live_column if c > 0 else None, tuple(sorted(writes.items())))


def build_mamba_metadata(meta: AttentionMetadata, plans: Sequence[StatePlan]) -> MambaMetadata:
    """``meta`` (the Mamba group's step metadata) plus the read/write blocks of ``plans`` (one per
    real row, in row order); padded rows and tokens get -1."""
    table = meta.block_table.cpu()
    qsl = (meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc).cpu()
    read = torch.full((meta.num_reqs,), NO_BLOCK, dtype=torch.int64)
    write = torch.full((meta.num_tokens,), NO_BLOCK, dtype=torch.int64)
    for row, plan in enumerate(plans):
        if plan.read_column is not None:
            read[row] = int(table[row, plan.read_column])
        for index, column in plan.writes:
            write[int(qsl[row]) + index] = int(table[row, column])
    device = meta.block_table.device
    fields = {name: getattr(meta, name) for name in AttentionMetadata.__dataclass_fields__}
    return MambaMetadata(**fields, read_blocks=read.to(device), write_blocks=write.to(device))


def state_views(state: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Split a layer's ``[num_blocks + 1, total]`` state tensor into ``[num_blocks + 1, *shape]`` views."""
    views, offset = [], 0
    for shape in shapes:
        size = prod(shape)
        views.append(state[:, offset : offset + size].view(state.shape[0], *shape))
        offset += size
    return views
