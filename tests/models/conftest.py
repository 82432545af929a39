"""A minimal paged generation harness (no scheduler): hand-built AttentionMetadata per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from paged_metadata import paged_metadata
from warmcap.contracts import PAD_SLOT_ID, ForwardContext
from warmcap.core.kv_spec import KVSpec, group_layers
from warmcap.core.reservation import reserved_blocks
from warmcap.runner_v2.attention.context import StepContext
from warmcap.runner_v2.attention.selector import backend_registry
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention

BLOCK_SIZE = 16
NUM_BLOCKS = 96
MAX_BLOCKS = 16
MAX_MODEL_LEN = MAX_BLOCKS * BLOCK_SIZE


@dataclass
class Seq:
    tokens: list[int]
    computed: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedHarness:
    """Runs a warmcap model step by step over random, non-contiguous blocks.

    ``pad_rows``/``pad_tokens`` append a padded row (seq_len 0, zero table row, PAD slots) to every
    step, as a graph-padded batch would have.
    """

    def __init__(
        self, model: torch.nn.Module, *, seed: int = 0, pad_rows: int = 0, pad_tokens: int = 0
    ) -> None:
        self.model = model
        self.specs: dict[str, KVSpec] = model.kv_layer_specs(BLOCK_SIZE)
        self.groups = group_layers(self.specs)
        dtype = next(model.parameters()).dtype
        self.caches = {
            name: torch.zeros(2, NUM_BLOCKS + 1, BLOCK_SIZE, spec.num_kv_heads, spec.head_size, dtype=dtype)
            for name, spec in self.specs.items()
        }
        self.layer_to_group = {layer: g.name for g in self.groups for layer in g.layer_names}
        self.backends = backend_registry(TorchPagedAttention())
        self.group_kinds = {g.name: g.spec.kind for g in self.groups}
        gen = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
        self.pad_rows, self.pad_tokens = pad_rows, pad_tokens

    def step(
        self, seqs: list[Seq], new: list[list[int]], *, aux_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, ForwardContext]:
        """Schedule ``new[i]`` for ``seqs[i]``; return last-position logits [R, vocab] and the context."""
        ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        r_total = len(seqs) + self.pad_rows
        table = torch.zeros(r_total, MAX_BLOCKS, dtype=torch.int32)
        spec = next(iter(self.specs.values()))
        for r, (seq, toks) in enumerate(zip(seqs, new, strict=True)):
            seq.tokens += toks
            total = seq.computed + len(toks)
            need = reserved_blocks(spec, total, num_lookahead_tokens=0, max_model_len=MAX_MODEL_LEN)
            seq.blocks += [self.free.pop() for _ in range(need - len(seq.blocks))]
            table[r, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
            for p in range(seq.computed, total):
                positions.append(p)
                slots.append(seq.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            ids += toks
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(total)
            seq.computed = total
        last = [q - 1 for q in qsl[1:]]
        for p in range(self.pad_rows):
            extra = self.pad_tokens if p == self.pad_rows - 1 else 0
            ids += [0] * extra
            positions += [0] * extra
            slots += [PAD_SLOT_ID] * extra
            qsl.append(qsl[-1] + extra)
            seq_lens.append(0)
        meta = paged_metadata(qsl, seq_lens, table, torch.tensor(slots, dtype=torch.int64), BLOCK_SIZE)
        ctx = StepContext(
            attn_metadata={g.name: meta for g in self.groups},
            layer_to_group=self.layer_to_group,
            kv_caches=self.caches,
            backends=self.backends,
            group_kinds=self.group_kinds,
            aux_hidden_state_layers=aux_layers,
        )
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), ctx)
            logits = self.model.compute_logits(hidden[torch.tensor(last)])
        return logits, ctx

    def greedy(self, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Prefill every prompt in one batch, then ``steps - 1`` batched decode steps.

        Returns generated tokens per prompt and the logits of every step."""
        seqs = [Seq([]) for _ in prompts]
        logits, _ = self.step(seqs, [list(p) for p in prompts])
        history = [logits]
        out = [[int(t)] for t in logits.argmax(-1)]
        for _ in range(steps - 1):
            logits, _ = self.step(seqs, [[o[-1]] for o in out])
            history.append(logits)
            for o, t in zip(out, logits.argmax(-1).tolist(), strict=True):
                o.append(int(t))
        return out, history


@pytest.fixture
def harness_cls() -> type[PagedHarness]:
    return PagedHarness


@pytest.fixture
def seq_cls() -> type[Seq]:
    return Seq
