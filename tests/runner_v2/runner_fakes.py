"""Test doubles for the runner: a tiny attention model, a loop-based paged attention reference and
a minimal scheduler that hands out blocks through the reservation rule."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import nn

from warmcap.contracts import AttentionBackend, AttentionMetadata
from warmcap.core.kv_spec import FullAttentionSpec, KVSpec
from warmcap.core.outputs import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from warmcap.core.reservation import reserved_blocks
from warmcap.sampling_params import SamplingParams


class LoopPagedAttention(AttentionBackend):
    """Per-request reference: write K/V through the slot mapping (PAD -> sink), then attend causally
    over the request's context gathered from its block table."""

    name = "loop"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, *, scale, sliding_window=None):
        sink = kv_cache.shape[1] - 1
        bs = kv_cache.shape[2]
        slots = meta.slot_mapping[: q.shape[0]]
        slots = torch.where(slots < 0, sink * bs + torch.arange(q.shape[0]) % bs, slots)
        kv_cache[0].view(-1, *kv_cache.shape[3:])[slots] = k
        kv_cache[1].view(-1, *kv_cache.shape[3:])[slots] = v
        out = torch.zeros_like(q)
        qsl = meta.query_start_loc.tolist()
        for r in range(meta.num_reqs):
            start, end, seq = qsl[r], qsl[r + 1], int(meta.seq_lens[r])
            if seq == 0 or end == start:
                continue
            pos = torch.arange(seq)
            slot = meta.block_table[r, pos // bs].long() * bs + pos % bs
            keys = kv_cache[0].view(-1, *kv_cache.shape[3:])[slot]
            vals = kv_cache[1].view(-1, *kv_cache.shape[3:])[slot]
            out[start:end] = _causal(q[start:end], keys, vals, scale, seq - (end - start))
        return out


def _causal(q, keys, vals, scale, first_pos):
    rep = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(rep, dim=1)
    vals = vals.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    qpos = torch.arange(q.shape[0]).unsqueeze(1) + first_pos
    mask = torch.arange(keys.shape[0]).unsqueeze(0) > qpos
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)


class DenseContext:
    """Plain causal attention over one whole sequence: the no-cache oracle."""

    def attention(self, layer_name, q, k, v, *, scale, sliding_window=None):
        return _causal(q, k, v, scale, 0)


class TinyAttnModel(nn.Module):
    """Embedding + learned positions + two attention layers with residuals + LM head."""

    def __init__(
        self, vocab: int = 64, hidden: int = 32, heads: int = 4, kv_heads: int = 2, max_pos: int = 512
    ):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_pos, hidden)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "q": nn.Linear(hidden, heads * self.head_dim),
                    "kv": nn.Linear(hidden, 2 * kv_heads * self.head_dim),
                    "o": nn.Linear(heads * self.head_dim, hidden),
                }
            )
            for _ in range(2)
        )
        self.head = nn.Linear(hidden, vocab)

    def kv_layer_specs(self, block_size: int) -> dict[str, KVSpec]:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=self.kv_heads, head_size=self.head_dim)
        return {f"layers.{i}.attn": spec for i in range(len(self.layers))}

    def forward(self, input_ids, positions, ctx, *, inputs_embeds=None):
        h = self.embed(input_ids) + self.pos(positions)
        for i, layer in enumerate(self.layers):
            q = layer["q"](h).view(-1, self.heads, self.head_dim)
            k, v = layer["kv"](h).view(-1, 2, self.kv_heads, self.head_dim).unbind(1)
            a = ctx.attention(f"layers.{i}.attn", q, k, v, scale=self.head_dim**-0.5)
            h = h + layer["o"](a.reshape(-1, self.heads * self.head_dim))
        return h

    def compute_logits(self, hidden):
        return self.head(hidden).float()

    @torch.no_grad()
    def dense_greedy(self, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        """Greedy continuation by full recompute, and the logits after the prompt."""
        ids = list(prompt)
        first = None
        for _ in range(n):
            t = torch.tensor(ids)
            logits = self.compute_logits(self.forward(t, torch.arange(len(ids)), DenseContext()))[-1]
            first = logits if first is None else first
            ids.append(int(logits.argmax()))
        return ids[len(prompt) :], first


@dataclass
class _Req:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    started: bool = False


class MiniScheduler:
    """FCFS, token budget, one group, fresh blocks from a counter; enough to drive the runner."""

    def __init__(self, spec: KVSpec, group: str, *, max_model_len: int, budget: int, lookahead: int = 0):
        self.spec, self.group, self.max_model_len = spec, group, max_model_len
        self.budget, self.lookahead = budget, lookahead
        self.reqs: dict[str, _Req] = {}
        self.finished: set[str] = set()
        self._next_block = itertools.count(1)
        self.done: dict[str, list[int]] = {}

    def add(self, req_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.reqs[req_id] = _Req(req_id, list(prompt), params)

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self.finished)
        self.finished = set()
        budget = self.budget
        for r in self.reqs.values():
            known = len(r.prompt) + len(r.output)
            spec = (drafts or {}).get(r.req_id, []) if r.computed == known - 1 else []
            n = min(known - r.computed + len(spec), budget)
            if n <= 0:
                continue
            if n < known - r.computed + len(spec):
                spec = []
            budget -= n
            need = reserved_blocks(
                self.spec,
                r.computed + n,
                num_lookahead_tokens=self.lookahead,
                max_model_len=self.max_model_len,
            )
            new = [next(self._next_block) for _ in range(need - len(r.blocks))]
            r.blocks += new
            if r.started:
                out.scheduled_cached_reqs.append(CachedRequestData(r.req_id, {self.group: new}, r.computed))
            else:
                r.started = True
                out.scheduled_new_reqs.append(
                    NewRequestData(r.req_id, r.prompt, r.params, {self.group: list(r.blocks)}, r.computed)
                )
            out.num_scheduled_tokens[r.req_id] = n
            if spec:
                out.scheduled_spec_decode_tokens[r.req_id] = spec
        return out

    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        for req_id, n in out.num_scheduled_tokens.items():
            r = self.reqs[req_id]
            sampled = result.by_request()[req_id]
            num_drafts = len(out.scheduled_spec_decode_tokens.get(req_id, []))
            r.computed += n - (num_drafts + 1 - len(sampled)) if sampled else n
            r.output += sampled
            if len(r.output) >= r.params.max_tokens:
                self.done[req_id] = r.output[: r.params.max_tokens]
                del self.reqs[req_id]
                self.finished.add(req_id)
