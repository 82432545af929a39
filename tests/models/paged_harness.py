"""A tiny paged driver for model parity tests: random distinct block ids, block counts from the
reservation rule, slot mappings from the block table, one metadata per KV group, Mamba state plans.

Not a runner: no scheduler, no sampler. Each :meth:`PagedHarness.step` takes the batch explicitly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from paged_metadata import paged_metadata
from warmcap.contracts import AttentionMetadata
from warmcap.core.kv_spec import FullAttentionSpec, KVSpec, MambaSpec, group_layers
from warmcap.core.reservation import reserved_blocks
from warmcap.runner_v2.attention.context import StepContext
from warmcap.runner_v2.attention.selector import backend_registry
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention
from warmcap.runner_v2.mamba_state import StatePlan, accepted_column, build_mamba_metadata, plan_state


@dataclass
class Request:
    computed: int = 0
    blocks: dict[str, list[int]] = field(default_factory=dict)
    live: dict[str, int | None] = field(default_factory=dict)
    # (committed token count, number of verified positions) of the last step, for the Mamba rollback
    last: tuple[int, int] = (0, 1)


def allocate_cache(spec: KVSpec, num_blocks: int) -> torch.Tensor:
    if isinstance(spec, MambaSpec):
        return torch.zeros(num_blocks + 1, spec.page_size_bytes // spec.dtype_bytes)
    if isinstance(spec, FullAttentionSpec):
        return torch.zeros(2, num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_size)
    return torch.zeros(num_blocks + 1, spec.block_size, spec.head_size)  # MLA / indexer


class PagedHarness:
    def __init__(
        self,
        model: torch.nn.Module,
        specs: dict[str, KVSpec],
        *,
        num_blocks: int = 96,
        seed: int = 0,
        max_model_len: int = 512,
    ) -> None:
        self.model = model
        self.groups = group_layers(specs)
        self.layer_to_group = {layer: g.name for g in self.groups for layer in g.layer_names}
        self.caches = {layer: allocate_cache(specs[layer], num_blocks) for layer in specs}
        self.free = list(range(1, num_blocks + 1))
        random.Random(seed).shuffle(self.free)
        self.max_model_len = max_model_len
        self.backends = backend_registry(TorchPagedAttention())
        self.group_kinds = {g.name: g.spec.kind for g in self.groups}
        self.requests: dict[str, Request] = {}

    def step(self, batch: list[tuple[str, list[int], int]]) -> torch.Tensor:
        """Run one forward over ``(req_id, token ids, num_spec_tokens)`` rows; logits [T, V].

        Every scheduled token counts as computed afterwards; :meth:`accept` rolls drafts back.
        """
        ids, positions, qsl = [], [], [0]
        for req_id, tokens, _ in batch:
            req = self.requests.setdefault(req_id, Request())
            ids += tokens
            positions += range(req.computed, req.computed + len(tokens))
            qsl.append(qsl[-1] + len(tokens))
        metas: dict[str, AttentionMetadata] = {}
        for group in self.groups:
            metas[group.name] = self._group_meta(group.name, group.spec, batch, qsl)
        ctx = StepContext(metas, self.layer_to_group, self.caches, self.backends, self.group_kinds)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), ctx)
            logits = self.model.compute_logits(hidden)
        for req_id, tokens, num_spec in batch:
            req = self.requests[req_id]
            req.last = (req.computed + len(tokens) - num_spec, 1 + num_spec)
            req.computed += len(tokens)
            for group in self.groups:
                if isinstance(group.spec, MambaSpec):
                    req.live[group.name] = accepted_column(group.spec, req.last[0], req.last[1])
        return logits

    def accept(self, req_id: str, num_accepted: int) -> None:
        """After a verify step: keep ``num_accepted`` of the verified positions (>= 1)."""
        req = self.requests[req_id]
        committed, verified = req.last
        req.computed -= verified - num_accepted
        for group in self.groups:
            if isinstance(group.spec, MambaSpec):
                req.live[group.name] = accepted_column(group.spec, committed, num_accepted)

    def _group_meta(
        self, name: str, spec: KVSpec, batch: list[tuple[str, list[int], int]], qsl: list[int]
    ) -> AttentionMetadata:
        bs = spec.block_size
        plans: list[StatePlan] = []
        seq_lens, slots = [], []
        for req_id, tokens, num_spec in batch:
            req = self.requests[req_id]
            held = req.blocks.setdefault(name, [])
            need = reserved_blocks(
                spec, req.computed + len(tokens), num_lookahead_tokens=0, max_model_len=self.max_model_len
            )
            while len(held) < need:
                held.append(self.free.pop())
            seq_lens.append(req.computed + len(tokens))
            for p in range(req.computed, req.computed + len(tokens)):
                slots.append(-1 if isinstance(spec, MambaSpec) else held[p // bs] * bs + p % bs)
            if isinstance(spec, MambaSpec):
                plans.append(
                    plan_state(
                        spec,
                        num_computed_tokens=req.computed,
                        num_scheduled_tokens=len(tokens),
                        num_spec_tokens=num_spec,
                        live_column=req.live.get(name),
                    )
                )
        width = max(len(self.requests[r].blocks[name]) for r, _, _ in batch)
        table = torch.zeros(len(batch), width, dtype=torch.int32)
        for row, (req_id, _, _) in enumerate(batch):
            held = self.requests[req_id].blocks[name]
            table[row, : len(held)] = torch.tensor(held, dtype=torch.int32)
        meta = paged_metadata(qsl, seq_lens, table, torch.tensor(slots, dtype=torch.int64), bs)
        return build_mamba_metadata(meta, plans) if isinstance(spec, MambaSpec) else meta


def greedy_decode(
    harness: PagedHarness, prompts: dict[str, list[int]], steps: int, chunk: int
) -> dict[str, list[int]]:
    """Prefill every prompt in chunks of ``chunk`` tokens, all requests in each step (mixed prefill
    and decode once short prompts finish), then decode greedily ``steps`` tokens per request."""
    out: dict[str, list[int]] = {r: [] for r in prompts}
    fed = dict.fromkeys(prompts, 0)
    while any(len(toks) < steps for toks in out.values()):
        batch, owners = [], []
        for req_id, prompt in prompts.items():
            if len(out[req_id]) >= steps:
                continue
            if fed[req_id] < len(prompt):
                piece = prompt[fed[req_id] : fed[req_id] + chunk]
                fed[req_id] += len(piece)
                done = fed[req_id] == len(prompt)
            else:
                piece, done = [out[req_id][-1]], True
            batch.append((req_id, piece, 0))
            owners.append((req_id, done))
        logits = harness.step(batch)
        ends = torch.tensor([len(b[1]) for b in batch]).cumsum(0) - 1
        for (req_id, done), end in zip(owners, ends.tolist(), strict=True):
            if done:
                out[req_id].append(int(logits[end].argmax()))
    return out


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def hf_last_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].float()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    # No EOS: the tiny presets use token 0 as EOS, and greedy must be compared token for token.
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()
