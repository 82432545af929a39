"""Verification of draft tokens: greedy and probabilistic (speculative sampling).

Row layout shared by both verifiers: request ``i`` with ``n_i`` draft tokens owns ``n_i + 1``
consecutive rows of the target tensor (one per draft position, then the bonus position), in request
order. ``draft_probs`` (when given) owns ``n_i`` consecutive rows per request. A request with no
drafts owns one row and simply gets the token the target picks there, so a verifier doubles as the
sampler of a whole batch.

Each verifier returns, per request, the accepted draft tokens followed by one token chosen by the
target (the correction at the first rejection, or the bonus after all drafts were accepted). The
``*_on_device`` forms stop before any host read and return :class:`Verified` (device tensors): the
runner fetches them with the step's other outputs in one copy (``runner_v2/host_copy.py``); the
draft layout goes the other way in one non-blocking copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from warmcap.runner_v2.host_copy import to_device


@dataclass(frozen=True, slots=True)
class _Layout:
    """Padded ``[R, K]`` views of ragged drafts and the row indices that gather them."""

    drafts: torch.Tensor  # int64 [R, K], -1 past each request's drafts
    valid: torch.Tensor  # bool [R, K]
    target_rows: torch.Tensor  # int64 [R, K + 1]; column j clamped to the request's bonus row
    draft_rows: torch.Tensor  # int64 [R, K]; rows of draft_probs (clamped, masked by ``valid``)
    num_drafts: torch.Tensor  # int64 [R]
    total_drafts: int  # sum of num_drafts, known on the host


def _layout(draft_token_ids: Sequence[Sequence[int]], device: torch.device) -> _Layout:
    """Built on the host, then moved as one tensor (one non-blocking copy, no wait)."""
    lens = [len(d) for d in draft_token_ids]
    num = torch.tensor(lens, dtype=torch.int64)
    num_reqs, k, total = len(lens), max(lens, default=0), sum(lens)
    drafts = torch.full((num_reqs, k), -1, dtype=torch.int64)
    for i, d in enumerate(draft_token_ids):
        if d:
            drafts[i, : len(d)] = torch.as_tensor(d, dtype=torch.int64)
    cols = torch.arange(k + 1, dtype=torch.int64)
    target_start = torch.cumsum(num + 1, 0) - (num + 1)
    target_rows = target_start[:, None] + torch.minimum(cols[None, :], num[:, None])
    draft_start = torch.cumsum(num, 0) - num
    draft_rows = draft_start[:, None] + torch.minimum(cols[None, :k], (num - 1).clamp(min=0)[:, None])
    # Requests with no drafts point past the end; their columns are masked, so any valid row will do.
    draft_rows = draft_rows.clamp(max=max(total - 1, 0))
    packed = to_device(torch.cat([drafts, target_rows, draft_rows, num[:, None]], dim=1), device)
    drafts, target_rows, draft_rows, num = packed.split([k, k + 1, k, 1], dim=1)
    num = num.squeeze(1)
    return _Layout(
        drafts=drafts,
        valid=torch.arange(k, device=device)[None, :] < num[:, None],
        target_rows=target_rows,
        draft_rows=draft_rows,
        num_drafts=num,
        total_drafts=total,
    )


def _check_rows(name: str, tensor: torch.Tensor, expected: int) -> None:
    if tensor.shape[0] != expected:
        raise ValueError(f"{name} has {tensor.shape[0]} rows; the drafts need {expected}")


@dataclass(frozen=True, slots=True)
class Verified:
    """A verifier's result still on the device: per request, the chosen tokens ``[R, K + 1]`` and
    how many leading drafts were accepted ``[R]``."""

    chosen: torch.Tensor
    num_accepted: torch.Tensor

    @property
    def parts(self) -> list[torch.Tensor]:
        """What to copy to the host for :meth:`emit`."""
        return [self.chosen, self.num_accepted]

    @staticmethod
    def emit(chosen: torch.Tensor, num_accepted: torch.Tensor) -> list[list[int]]:
        """Row ``i`` of host ``chosen`` truncated to ``num_accepted[i] + 1`` tokens."""
        rows = chosen.tolist()
        return [row[: n + 1] for row, n in zip(rows, num_accepted.tolist(), strict=True)]

    def tokens(self) -> list[list[int]]:
        """The tokens per request (a host read of its own)."""
        return self.emit(self.chosen.cpu(), self.num_accepted.cpu())


def greedy_verify(target_argmax: torch.Tensor, draft_token_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """Accept drafts while they equal the target's argmax; then emit the target's own token.

    ``target_argmax`` is int [sum(n_i + 1)] in the row layout of the module docstring.
    """
    return greedy_verify_on_device(target_argmax, draft_token_ids).tokens()


def greedy_verify_on_device(
    target_argmax: torch.Tensor, draft_token_ids: Sequence[Sequence[int]]
) -> Verified:
    """:func:`greedy_verify` without the host read."""
    lay = _layout(draft_token_ids, target_argmax.device)
    _check_rows("target_argmax", target_argmax, lay.total_drafts + len(draft_token_ids))
    target = target_argmax.to(torch.int64)[lay.target_rows]  # [R, K + 1]
    k = lay.drafts.shape[1]
    match = (lay.drafts == target[:, :k]) & lay.valid
    num_accepted = torch.cumprod(match.to(torch.int64), dim=1).sum(dim=1)
    # Accepted drafts equal the target's argmax, so the target row itself is the output.
    return Verified(target, num_accepted)


def _draw_noise(
    draft_token_ids: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
    k: int,
    vocab: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request uniforms ``[R, K]`` and exponentials ``[R, V]`` from each request's generator.

    NOTE: each request draws exactly ``n_i`` uniforms and ``V`` exponentials from its own generator,
    so a seeded request samples the same tokens whatever else is in the batch.
    """
    num_reqs = len(draft_token_ids)
    uniform = torch.zeros(num_reqs, k, device=device)
    expo = torch.empty(num_reqs, vocab, device=device)
    for i, (drafts, gen) in enumerate(zip(draft_token_ids, generators, strict=True)):
        n = len(drafts)
        if n:
            uniform[i, :n] = torch.rand(n, generator=gen, device=device)
        expo[i].exponential_(generator=gen)
    # An exact 0 would turn a zero-probability token into 0/0 in the exponential race.
    return uniform, expo.clamp_(min=torch.finfo(expo.dtype).tiny)


def probabilistic_verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None] | None = None,
) -> list[list[int]]:
    """Speculative sampling: the output tokens are distributed exactly as sampling from the target.

    Draft ``x`` at position ``j`` is accepted with probability ``min(1, p_j(x) / q_j(x))``; at the first
    rejection the token is drawn from ``normalize(max(p_j - q_j, 0))``; when every draft is accepted the
    bonus token is drawn from ``p`` at the last row.

    - ``target_probs`` float [sum(n_i + 1), V]: the target's (temperature / top-k / top-p processed)
      distribution per row.
    - ``draft_probs`` float [sum(n_i), V] or ``None`` for drafters without a distribution (ngram):
      ``q`` is then one-hot on the draft token.
    - ``generators``: one per request (``None`` entries use the global generator); a seeded
      generator makes that request's output independent of the rest of the batch.
    """
    return probabilistic_verify_on_device(target_probs, draft_probs, draft_token_ids, generators).tokens()


def probabilistic_verify_on_device(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None] | None = None,
) -> Verified:
    """:func:`probabilistic_verify` without the host read."""
    device = target_probs.device
    num_reqs = len(draft_token_ids)
    lay = _layout(draft_token_ids, device)
    _check_rows("target_probs", target_probs, lay.total_drafts + num_reqs)
    if draft_probs is not None:
        _check_rows("draft_probs", draft_probs, lay.total_drafts)
    if generators is None:
        generators = [None] * num_reqs
    if len(generators) != num_reqs:
        raise ValueError(f"{len(generators)} generators for {num_reqs} requests")
    k = lay.drafts.shape[1]
    vocab = target_probs.shape[1]
    uniform, expo = _draw_noise(draft_token_ids, generators, k, vocab, device)

    safe_drafts = lay.drafts.clamp(min=0)
    p = target_probs.float()[lay.target_rows]  # [R, K + 1, V]
    p_x = p[:, :k].gather(-1, safe_drafts[..., None]).squeeze(-1)  # [R, K]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.float()[lay.draft_rows].gather(-1, safe_drafts[..., None]).squeeze(-1)
    # u < p/q written without the division; q(x) = 0 with p(x) > 0 always accepts.
    accept = (uniform * q_x < p_x) & lay.valid
    num_accepted = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)  # [R]

    rows = torch.arange(num_reqs, device=device)
    p_last = p[rows, num_accepted]  # [R, V]: rejection row, or the bonus row when all accepted
    rejected = num_accepted < lay.num_drafts
    if k == 0:
        q_last = torch.zeros_like(p_last)
    else:
        col = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_last = torch.nn.functional.one_hot(safe_drafts[rows, col], vocab).to(p_last.dtype)
        else:
            q_last = draft_probs.float()[lay.draft_rows[rows, col]]
    residual = (p_last - q_last).clamp(min=0.0)
    # NOTE: p == q makes the residual all-zero; a rejection then only happens by rounding, and p is
    # the distribution the token must follow anyway.
    degenerate = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(degenerate, p_last, residual)
    final = torch.where(rejected[:, None], residual, p_last)
    # Exponential race: argmax(w / E) with E ~ Exp(1) picks index j with probability w_j / sum(w).
    sampled = torch.argmax(final / expo, dim=-1)

    chosen = torch.cat([safe_drafts, torch.zeros(num_reqs, 1, dtype=torch.int64, device=device)], dim=1)
    chosen[rows, num_accepted] = sampled
    return Verified(chosen, num_accepted)


def num_accepted_drafts(outputs: Sequence[Sequence[int]]) -> list[int]:
    """Accepted draft count per request from a verifier's output (all but the final token)."""
    return [max(len(out) - 1, 0) for out in outputs]
