"""What the runner hands its drafter: the drafter is a callee and reads nothing else of the runner.

- :class:`DraftContext`, once per engine step, to ``Drafter.propose``: the step as the drafter
  sees it (:class:`StepView`), the target's hidden and auxiliary states, the persistent batch's
  tokens, and ``run_pass``, the runner's pass executor bound to this drafter (it loads the drafter
  buffers, replays a captured drafter graph that fits or calls ``forward_pass``, and logs the
  pass's KV writes).
- :class:`DraftKV`, per pass, to ``Drafter.forward_pass`` and ``Drafter.state_metadata``: the KV
  tensors, the attention backends and the block tables the pass runs over. The runner builds it at
  call time (:meth:`ModelRunner.draft_kv`), so a pass run under substituted caches (graph safety's
  fake tensors) sees those.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

    from warmcap.contracts.registry import BackendRegistry
    from warmcap.runner_v2.input_batch import StepInputs


@dataclass(slots=True)
class DraftPass:
    """One drafter forward over ragged per-request position spans."""

    req_ids: list[str]
    rows: np.ndarray  # int64 [R] persistent-batch rows
    query_start_loc: np.ndarray  # int32 [R + 1]
    positions: np.ndarray  # int64 [T]
    seq_lens: np.ndarray  # int32 [R]: last position written + 1

    @classmethod
    def spans(
        cls, req_ids: Sequence[str], rows: np.ndarray, first: np.ndarray, lengths: np.ndarray
    ) -> DraftPass:
        """Request ``i`` queries positions ``first[i] .. first[i] + lengths[i] - 1``; requests with
        no positions are dropped."""
        keep = np.flatnonzero(lengths > 0)
        lengths = lengths[keep].astype(np.int64)
        first = first[keep].astype(np.int64)
        qsl = np.zeros(len(keep) + 1, dtype=np.int32)
        np.cumsum(lengths, out=qsl[1:])
        total = int(qsl[-1])
        offsets = np.arange(total, dtype=np.int64) - np.repeat(qsl[:-1].astype(np.int64), lengths)
        positions = np.repeat(first, lengths) + offsets
        return cls(
            req_ids=[req_ids[i] for i in keep.tolist()],
            rows=rows[keep],
            query_start_loc=qsl,
            positions=positions,
            seq_lens=(first + lengths).astype(np.int32),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def query_lens(self) -> np.ndarray:
        return (self.query_start_loc[1:] - self.query_start_loc[:-1]).astype(np.int64)

    def last_token_index(self) -> np.ndarray:
        """Index, within the pass, of each request's last query token."""
        return self.query_start_loc[1:].astype(np.int64) - 1


@dataclass(frozen=True, slots=True)
class StepView:
    """What the target step left for the drafter, per scheduled request (step order).

    - ``start``: the first position computed this step (``num_computed_tokens`` before the step)
    - ``num_valid``: positions ``start .. start + num_valid - 1`` hold target states of real tokens
      (scheduled tokens minus rejected drafts)
    - ``sampled``: whether a token was sampled; it sits at position ``start + num_valid``
    - ``token_offset``: index of position ``start`` in the target's hidden states
    """

    req_ids: list[str]
    rows: np.ndarray
    start: np.ndarray
    num_valid: np.ndarray
    sampled: np.ndarray
    token_offset: np.ndarray

    @classmethod
    def from_step(cls, step: StepInputs, sampled: Sequence[Sequence[int]]) -> StepView:
        """The view of target step ``step``, in which request ``i`` gained ``sampled[i]``
        (accepted drafts plus the sampled token; empty for a prompt chunk)."""
        qsl = step.query_start_loc
        start = step.positions[qsl[:-1]] if step.num_tokens else np.zeros(0, dtype=np.int64)
        num_drafts = np.fromiter((len(d) for d in step.draft_token_ids), dtype=np.int64, count=step.num_reqs)
        num_out = np.fromiter((len(s) for s in sampled), dtype=np.int64, count=step.num_reqs)
        accepted = np.maximum(num_out - 1, 0)
        # A request that sampled keeps its accepted drafts; one that did not had no drafts.
        num_valid = step.num_scheduled.astype(np.int64) - np.where(num_out > 0, num_drafts - accepted, 0)
        return cls(
            req_ids=list(step.req_ids),
            rows=step.rows.astype(np.int64),
            start=start.astype(np.int64),
            num_valid=num_valid,
            sampled=num_out > 0,
            token_offset=qsl[:-1].astype(np.int64),
        )

    @property
    def next_position(self) -> np.ndarray:
        """Position of the token sampled this step (meaningful where ``sampled``)."""
        return self.start + self.num_valid

    def valid_state_index(self) -> np.ndarray:
        """Row of the target's step hidden states for each valid position, requests in order."""
        firsts = np.cumsum(self.num_valid) - self.num_valid
        within = np.arange(int(self.num_valid.sum())) - np.repeat(firsts, self.num_valid)
        return np.repeat(self.token_offset, self.num_valid) + within


class RunDraftPass(Protocol):
    """The runner's executor of one drafter pass, as the drafter receives it."""

    def __call__(
        self,
        dp: DraftPass,
        *,
        phase: str,
        log_phase: str,
        input_ids: torch.Tensor,
        features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One ``phase`` pass over ``dp`` (graph replay or eager), its KV writes logged under
        ``log_phase`` while recording; returns ``[T, H]``."""
        ...


@dataclass(frozen=True, slots=True)
class DraftKV:
    """The runner's state one drafter pass runs over."""

    #: KV tensor per full layer name (a drafter's layers are ``draft.``-prefixed)
    kv_caches: Mapping[str, torch.Tensor]
    #: the backend of each KV kind
    backends: BackendRegistry
    #: persistent-batch block table ``[rows, columns]`` per KV group
    block_tables: Mapping[str, np.ndarray]
    #: tokens known per persistent-batch row
    num_tokens: np.ndarray


@dataclass(frozen=True, slots=True)
class DraftContext:
    """What one engine step hands the drafter's ``propose``."""

    view: StepView
    #: the target's final hidden states of the step ``[T, H]`` (rows as ``view.token_offset``)
    hidden_states: torch.Tensor
    #: the inputs of the drafter's ``aux_layers`` in the target, same rows (empty without)
    aux_hidden_states: Sequence[torch.Tensor]
    #: persistent-batch tokens ``[rows, max_model_len]`` (this step's sampled tokens appended)
    token_ids: np.ndarray
    #: tokens known per persistent-batch row
    num_tokens: np.ndarray
    device: torch.device
    max_model_len: int
    run_pass: RunDraftPass
