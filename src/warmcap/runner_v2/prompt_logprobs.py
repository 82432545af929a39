"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``) computed from a step's hidden states.

Prompt position ``p`` (``p >= 1``) gets the log-probability of prompt token ``p`` under the
distribution the model gives after tokens ``0..p-1``: the logits of the hidden state at position
``p - 1``. A step holding a prompt chunk ``[c, c + n)`` therefore covers positions ``c + 1`` to
``min(c + n, P - 1)`` (``P`` prompt tokens): a chunked prompt is covered chunk by chunk, and the last
prompt position's hidden state is the one that samples, not a prompt logprob.

Full-vocabulary logits for a whole prompt would be ``P x V`` floats (a 2048-token prompt over a
49k vocabulary is 400 MB in float32), so rows go through the LM head ``CHUNK_ROWS`` at a time and
only the per-position results are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

#: most hidden rows turned into full-vocabulary logits at once (256 x 49152 float32 = 50 MB)
CHUNK_ROWS = 256


@dataclass(slots=True)
class PromptLogprobsPart:
    """One request's prompt logprobs from one step: positions ``start .. start + len(token_ids) - 1``.

    ``token_ids[j]`` is the prompt token at position ``start + j``, ``logprobs[j]`` its log-probability
    and ``ranks[j]`` its rank (1 = most likely); ``top_ids[j]`` / ``top_logprobs[j]`` the request's
    ``prompt_logprobs`` most likely tokens there, most likely first.
    """

    start: int
    token_ids: np.ndarray  # int64 [n]
    logprobs: np.ndarray  # float32 [n]
    ranks: np.ndarray  # int64 [n]
    top_ids: np.ndarray  # int64 [n, k]
    top_logprobs: np.ndarray  # float32 [n, k]


def prompt_logprobs_parts(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    *,
    req_ids: list[str],
    rows: np.ndarray,
    num_top: np.ndarray,
    query_start: np.ndarray,
    computed: np.ndarray,
    num_scheduled: np.ndarray,
    num_prompt_tokens: np.ndarray,
    token_ids: np.ndarray,
    chunk_rows: int = CHUNK_ROWS,
) -> dict[str, PromptLogprobsPart]:
    """Each request's part of this step (requests with ``num_top[i] < 0`` asked for none).

    ``hidden`` ``[T, H]`` holds the step's tokens, request ``i``'s from ``query_start[i]``, at
    positions ``computed[i]`` onwards; ``token_ids[rows[i]]`` is that request's tokens (prompt first).
    At most ``chunk_rows`` rows of full-vocabulary logits exist at once.
    """
    wants = num_top >= 0
    # Hidden states at positions [computed, end) predict prompt tokens computed + 1 .. end.
    ends = np.minimum(computed + num_scheduled, num_prompt_tokens - 1)
    counts = np.where(wants, np.maximum(ends - computed, 0), 0).astype(np.int64)
    total = int(counts.sum())
    if total == 0:
        return {}
    firsts = np.repeat(np.cumsum(counts) - counts, counts)
    offsets = np.arange(total, dtype=np.int64) - firsts
    hidden_index = np.repeat(query_start.astype(np.int64), counts) + offsets
    target_pos = np.repeat(computed.astype(np.int64) + 1, counts) + offsets
    targets = token_ids[np.repeat(rows, counts), target_pos]
    k = int(num_top[wants].max())

    device = hidden.device
    index = torch.from_numpy(hidden_index).to(device)
    target = torch.from_numpy(targets).to(device)
    chosen_parts, rank_parts, top_lp_parts, top_id_parts = [], [], [], []
    for s in range(0, total, chunk_rows):
        logprobs = compute_logits(hidden[index[s : s + chunk_rows]]).float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, target[s : s + chunk_rows].unsqueeze(1))
        chosen_parts.append(chosen.squeeze(1))
        rank_parts.append((logprobs > chosen).sum(dim=-1) + 1)
        if k:
            top = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
            top_lp_parts.append(top.values)
            top_id_parts.append(top.indices)
    chosen_all = torch.cat(chosen_parts).cpu().numpy()
    ranks_all = torch.cat(rank_parts).cpu().numpy()
    if k:
        top_lp_all = torch.cat(top_lp_parts).cpu().numpy()
        top_id_all = torch.cat(top_id_parts).cpu().numpy()
    else:
        top_lp_all = np.zeros((total, 0), dtype=np.float32)
        top_id_all = np.zeros((total, 0), dtype=np.int64)

    parts: dict[str, PromptLogprobsPart] = {}
    first = 0
    for i, req_id in enumerate(req_ids):
        n = int(counts[i])
        if not n:
            continue
        sl = slice(first, first + n)
        ki = int(num_top[i])
        parts[req_id] = PromptLogprobsPart(
            start=int(computed[i]) + 1,
            token_ids=targets[sl],
            logprobs=chosen_all[sl],
            ranks=ranks_all[sl],
            top_ids=top_id_all[sl, :ki],
            top_logprobs=top_lp_all[sl, :ki],
        )
        first += n
    return parts
