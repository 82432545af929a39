"""What the runner hands its drafter: the drafter is a callee and reads nothing else of the runner.

- :class:`DraftContext`, once per engine step, to ``Drafter.propose``: the step as the drafter
  sees it (:class:`StepView`), the target's hidden and auxiliary states and the persistent batch's
  tokens. It carries no way back into the runner.
- :class:`DraftPasses`, once, to ``Drafter.bind``: the runner's draft executor
  (``runner_v2/draft_executor.py``), which runs the drafter's passes (it loads the drafter
  buffers, replays a captured drafter graph that fits or calls ``DraftModel.forward_pass``, and
  logs the pass's KV writes).
- :class:`DraftKV`, per pass, to ``DraftModel.forward_pass`` and ``DraftModel.state_metadata``:
  the KV tensors, the attention backends and the block tables the pass runs over. The executor
  builds it at call time (:meth:`DraftExecutor.kv`), so a pass run under substituted caches (graph
  safety's fake tensors) sees those.
- :class:`DraftTokens`, what ``propose`` returns: the drafts on the device, with their positions,
  and how many each request has (known on the host without reading the device).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
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


class DraftPasses(Protocol):
    """The runner's executor of drafter passes, as the drafter receives it (once, at bind time)."""

    @property
    def device(self) -> torch.device:
        """Where the passes run (and drafts live)."""
        ...

    def run(
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


@dataclass(frozen=True, slots=True)
class DraftTokens:
    """One step's proposals, left on the device for the next step's verification.

    Row ``i`` belongs to ``req_ids[i]`` (the requests that drafted, in step order) and holds
    ``num_drafts[i] >= 1`` drafts; the counts are host data (every drafter knows them before it
    runs: a model drafter drafts its budget, n-gram looks up on the host), so the scheduler's
    bookkeeping never waits on the device.
    """

    req_ids: list[str]
    #: int64 [R] on the host
    num_drafts: np.ndarray
    #: int64 [R, K] on the device, -1 past each row's drafts
    token_ids: torch.Tensor
    #: int64 [R, K] on the device: the position each draft takes in the next step (-1 past the drafts)
    positions: torch.Tensor
    #: ``token_ids`` on the host as well, when the strategy made them there (n-gram): read for free
    host_token_ids: np.ndarray | None = None

    @classmethod
    def none(cls, device: torch.device) -> DraftTokens:
        """No request drafted."""
        empty = torch.zeros(0, 0, dtype=torch.int64, device=device)
        return cls([], np.zeros(0, dtype=np.int64), empty, empty)

    @classmethod
    def from_rows(
        cls,
        req_ids: Sequence[str],
        num_drafts: np.ndarray,
        token_ids: torch.Tensor,
        first_position: np.ndarray,
        *,
        host_token_ids: np.ndarray | None = None,
    ) -> DraftTokens:
        """Drafts ``token_ids`` [R, K] (-1 padded) of requests whose first draft sits at
        ``first_position`` [R]; requests with no draft are dropped (on the host: ``num_drafts``).
        ``host_token_ids``: the same drafts on the host, when they were made there."""
        keep = np.flatnonzero(num_drafts > 0)
        num = num_drafts[keep].astype(np.int64)
        k = token_ids.shape[1] if token_ids.dim() == 2 else 0
        device = token_ids.device
        if keep.size == 0:
            return cls.none(device)
        if keep.size != len(req_ids):
            token_ids = token_ids[torch.from_numpy(keep).to(device)]
            host_token_ids = host_token_ids[keep] if host_token_ids is not None else None
        cols = np.arange(k, dtype=np.int64)
        positions = np.where(cols[None, :] < num[:, None], first_position[keep, None] + cols[None, :], -1)
        return cls(
            [req_ids[i] for i in keep.tolist()],
            num,
            token_ids,
            torch.from_numpy(positions).to(device, non_blocking=True),
            host_token_ids,
        )

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def to_lists(self) -> dict[str, list[int]]:
        """The drafts per request on the host (what the scheduler records): one device read, none
        when the strategy made them on the host."""
        if not self.req_ids:
            return {}
        rows = (self.host_token_ids if self.host_token_ids is not None else self.token_ids.cpu()).tolist()
        return {r: row[:n] for r, row, n in zip(self.req_ids, rows, self.num_drafts.tolist(), strict=True)}
