"""Invariant I4 for target graphs: the real batch of a check and its three passes.

The reference is a full recompute: each row's whole sequence (context and the checked step's
tokens) runs in one unpadded eager prefill, which writes the contexts the replay and the padded
pass read and gives the real rows' outputs (auxiliary hidden states included) and cache entries
at the step's positions — the reference and the context writes in one forward, where a separate
context prefill and an eager step cost two. The checked step then runs replayed and padded
eagerly. Subjects with Mamba state (whose state per block is not a function of the tokens alone:
odd rows start from zero) and rows too long for one pass keep the two-pass form: contexts by eager
prefills, then the step unpadded. What the passes are held to lives in
:mod:`warmcap.graphs.proof.verify`; the batch's vocabulary in :mod:`warmcap.graphs.proof.verify_batch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from warmcap.core.kv_spec import MambaSpec
from warmcap.graphs.proof.verify_batch import VERIFY_REQ_PREFIX, Passes, context_chunks, row_chunks
from warmcap.runner_v2.input_batch import StepInputs

if TYPE_CHECKING:
    from warmcap.graphs.capture.capturer import CapturedGraph
    from warmcap.graphs.capture.subjects import TargetSubject
    from warmcap.graphs.proof.verify_batch import Layout


def target_step(
    tokens: list[np.ndarray],
    starts: list[int],
    lens: list[int],
    tables: dict[str, torch.Tensor],
    num_blocks: int,
    *,
    decode: bool,
) -> StepInputs:
    r = len(lens)
    qsl = np.zeros(r + 1, dtype=np.int32)
    np.cumsum(lens, out=qsl[1:])
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens, strict=True)]).astype(
        np.int64
    )
    input_ids = np.concatenate([tok[s : s + n] for tok, s, n in zip(tokens, starts, lens, strict=True)])
    # Decode rows sample every token (the sampled one and its drafts); a prompt chunk samples none.
    num_logits = np.array(lens if decode else [0] * r, dtype=np.int32)
    logits_indices = np.concatenate(
        [np.arange(qsl[i + 1] - n, qsl[i + 1]) for i, n in enumerate(num_logits)] + [np.zeros(0)]
    ).astype(np.int64)
    return StepInputs(
        req_ids=[f"{VERIFY_REQ_PREFIX}{i}" for i in range(r)],
        rows=np.arange(r, dtype=np.int64),
        num_scheduled=np.array(lens, dtype=np.int32),
        query_start_loc=qsl,
        positions=positions,
        input_ids=input_ids.astype(np.int64),
        seq_lens=np.array([s + n for s, n in zip(starts, lens, strict=True)], dtype=np.int32),
        block_tables=tables,
        logits_indices=logits_indices,
        num_logits=num_logits,
        draft_token_ids=[
            list(map(int, tok[s + 1 : s + n])) if decode else []
            for tok, s, n in zip(tokens, starts, lens, strict=True)
        ],
        max_num_blocks=num_blocks,
    )


def target_passes(
    subject: TargetSubject,
    graph: CapturedGraph,
    layout: Layout,
    tables: dict[str, torch.Tensor],
    num_blocks: int,
    rng: np.random.Generator,
    vocab: int,
) -> Passes:
    """The passes of one target graph's check over ``layout`` on scratch ``tables``."""
    runner = subject.runner
    buffers = subject.buffers
    spec = graph.spec
    lens, contexts = layout.query_lens, layout.contexts
    tokens = [rng.integers(0, vocab, size=c + n) for c, n in zip(contexts, lens, strict=True)]
    sizes = [c + n for c, n in zip(contexts, lens, strict=True)]
    stateful = any(isinstance(g.spec, MambaSpec) for g in subject.groups())
    recompute = not stateful and max(sizes) <= buffers.max_num_tokens
    for rows in [] if recompute else context_chunks(contexts, buffers.max_num_tokens):
        # Contexts of these rows, written by one eager prefill (a real model costs a forward each).
        sub = {g: t[rows] for g, t in tables.items()}
        prefill = target_step(
            [tokens[i] for i in rows],
            [0] * len(rows),
            [contexts[i] for i in rows],
            sub,
            num_blocks,
            decode=False,
        )
        buffers.copy_from(prefill)
        runner.forward_batch(prefill.num_tokens, buffers.attn_metadata(num_columns=num_blocks))

    step = target_step(tokens, contexts, lens, tables, num_blocks, decode=layout.decode)
    t, n = step.num_tokens, spec.num_tokens
    buffers.copy_from(step)
    # The state columns the pass itself would plan, made here so the blocks it writes are known.
    metas = runner.state_metadata(buffers.attn_metadata(num_columns=num_blocks))
    last = torch.as_tensor(step.query_start_loc[1:] - 1, dtype=torch.int64, device=runner.device)

    def reference() -> list[torch.Tensor]:
        if recompute:
            return _recomputed(subject, tokens, sizes, lens, tables, num_blocks)
        hidden = runner.forward_batch(t, metas)
        return [hidden[:t], *(a[:t] for a in runner.last_aux_hidden_states)]

    def replay() -> list[torch.Tensor]:
        subject.load(spec, step)
        graph.replay_fn()
        return [graph.output[:n], *(a[:n] for a in graph.aux)]

    def padded_eager() -> list[torch.Tensor]:
        subject.load(spec, step)
        hidden, aux = subject.forward(spec, graph.metas)
        return [hidden[:n], *(a[:n] for a in aux)]

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        return runner.model.compute_logits(hidden[last])

    def greedy(hidden: torch.Tensor) -> torch.Tensor:
        return logits(hidden).argmax(-1)

    return Passes(step.num_reqs, metas, reference, replay, padded_eager, greedy, logits)


def _recomputed(
    subject: TargetSubject,
    tokens: list[np.ndarray],
    sizes: list[int],
    lens: list[int],
    tables: dict[str, torch.Tensor],
    num_blocks: int,
) -> list[torch.Tensor]:
    """Outputs at the last ``lens[i]`` positions of each row, row after row, from eager prefills of
    the rows' whole sequences (``sizes[i]`` tokens from position 0), as few passes as fit."""
    runner, buffers = subject.runner, subject.buffers
    pieces: list[list[torch.Tensor]] = []
    for rows in row_chunks(sizes, buffers.max_num_tokens):
        sub = {g: t[rows] for g, t in tables.items()}
        full = target_step(
            [tokens[i] for i in rows],
            [0] * len(rows),
            [sizes[i] for i in rows],
            sub,
            num_blocks,
            decode=False,
        )
        buffers.copy_from(full)
        hidden = runner.forward_batch(full.num_tokens, buffers.attn_metadata(num_columns=num_blocks))
        ends = full.query_start_loc[1:]
        at = np.concatenate([np.arange(e - lens[i], e) for e, i in zip(ends, rows, strict=True)])
        index = torch.as_tensor(at, dtype=torch.int64, device=runner.device)
        pieces.append([o[index] for o in (hidden, *runner.last_aux_hidden_states)])
    return [torch.cat(parts) for parts in zip(*pieces, strict=True)]
