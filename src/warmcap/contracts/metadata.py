"""What a forward reads about the step: per-KV-group attention metadata, and its Mamba extension.

KV tensor layout (full / sliding-window attention): ``[2, num_blocks + 1, block_size, num_kv_heads,
head_size]``; MLA latents and indexer keys: ``[num_blocks + 1, block_size, dim]``; Mamba states:
``[num_blocks + 1, conv + ssm elements]`` (see :mod:`warmcap.runner_v2.kv_cache`). The extra last
block (index ``num_blocks``) is the *sink*: PAD slots (-1) are redirected there so writes stay
graph-safe (no boolean indexing) and never touch the null block 0. No block table ever names the
sink, so attention never reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PAD_SLOT_ID = -1


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step, per-KV-group inputs of attention. Row i is request i of the flattened batch.

    - ``query_start_loc`` int32 [R+1]: query tokens of row i are ``[qsl[i], qsl[i+1])``;
      ``qsl[R] == num_tokens`` (padded tokens belong to padded rows).
    - ``seq_lens`` int32 [R]: context length after this step (computed + scheduled); the queries of
      row i sit at positions ``seq_len - query_len .. seq_len - 1``. Padded rows have 0 and their
      outputs are zero.
    - ``block_table`` int32 [R, max_blocks]: padded rows are all zero (the null block).
    - ``slot_mapping`` int64 [T]: ``block * block_size + offset`` or PAD (-1) for padded tokens.
    - ``graph_bounds``: ``max_query_len`` / ``max_seq_len`` are a graph's static maxima (the full
      block-table width, ``max_model_len``), not this step's: one recorded graph serves every batch
      dispatched to it. A backend must then take lengths from the tensors (read the pages in place
      below each row's ``seq_len``) rather than size its work by the host maxima, or every step pays
      for ``max_model_len`` (``graphs/capture/static_inputs.py`` sets it).
    """

    num_tokens: int
    num_reqs: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies, so backends can plan without a device sync.
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    graph_bounds: bool = False


@dataclass(slots=True)
class MambaMetadata(AttentionMetadata):
    """Attention metadata of a Mamba group plus where each row's state is read and written.

    - ``read_blocks`` int64 [R]: the block holding the state a row starts from; -1: zero state
      (a new request, or a padded row).
    - ``write_blocks`` int64 [T]: the block receiving the state reached after token t; -1: none.
    - ``static``: the metadata of a graph's static buffers: every pass refills ``read_blocks`` and
      ``write_blocks`` in place (same tensors) for the step loaded there.

    The runner's Mamba state handler (:mod:`warmcap.runner_v2.mamba_state`) plans the blocks.
    """

    read_blocks: torch.Tensor | None = None
    write_blocks: torch.Tensor | None = None
    static: bool = False
