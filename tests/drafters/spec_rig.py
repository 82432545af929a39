"""Drive a real :class:`LLMEngine` (scheduler, KV cache manager, runner, drafter) one step at a time,
snapshotting the blocks the manager holds for each request at every step, for drafter tests."""

from __future__ import annotations

import random
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.core.request import Request
from warmcap.engine import LLMEngine
from warmcap.metrics import SpecDecodeMetrics
from warmcap.sampling_params import SamplingParams

BLOCK_SIZE = 16
TINY_VOCAB = 512  # every tiny preset shares the tiny BPE tokenizer


def prompts(vocab: int, lengths: tuple[int, ...], seed: int = 0, repetitive: bool = False) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for n in lengths:
        if repetitive:
            motif = [rng.randrange(3, vocab) for _ in range(5)]
            out.append((motif * (n // 5 + 1))[:n])
        else:
            out.append([rng.randrange(3, vocab) for _ in range(n)])
    return out


@dataclass
class SpecRig:
    """Drive ``schedule -> execute_model -> update_from_output`` one step at a time."""

    model_name: str = "tiny-llama"
    spec: str | None = None
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 24
    max_model_len: int = 128
    num_blocks: int = 200
    record: bool = True
    lookahead_override: int | None = None
    outputs: dict[str, list[int]] = field(default_factory=dict)
    held: list[dict[str, dict[str, list[int]]]] = field(default_factory=list)
    proposals: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    metrics: SpecDecodeMetrics = field(default_factory=SpecDecodeMetrics)
    #: holds the runner's recording scope open for the rig's life (its runner is never shared)
    scope: ExitStack = field(default_factory=ExitStack)

    def __post_init__(self) -> None:
        config = EngineConfig(
            model=ModelConfig(model=self.model_name, device="cpu"),
            cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=self.num_blocks),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len,
            ),
            speculative=SpeculativeConfig.parse(self.spec),
        )
        self.engine = LLMEngine(config, startup_hooks=[])
        self.config = self.engine.config
        self.model = self.engine.model
        self.drafter = self.engine.drafter
        self.manager = self.engine.kv_cache_manager
        self.scheduler = self.engine.scheduler
        self.runner = self.engine.runner
        if self.lookahead_override is not None:
            self._reserve_short(self.lookahead_override)
        self.scope.enter_context(self.runner.recording_kv_writes(self.record))
        if self.drafter is not None:
            self._spy()

    def _reserve_short(self, lookahead: int) -> None:
        """Test-only seam: the KV cache manager reserves as if the drafter wrote only ``lookahead``
        ahead, while each step still tells the runner the config's lookahead, so the drafter runs."""
        allocate = self.manager.allocate_slots

        def allocate_short(request, num_new_tokens, **kwargs):
            kwargs["num_lookahead_tokens"] = lookahead
            return allocate(request, num_new_tokens, **kwargs)

        self.manager.allocate_slots = allocate_short

    def _spy(self) -> None:
        """Record each proposal with the request's tokens at the time it was made."""
        inner = self.drafter.propose

        def propose(ctx):
            drafts = inner(ctx)
            # The drafts come back on the device; the spy reads them (the runner reads them too).
            for req_id, d in drafts.to_lists().items():
                row = ctx.view.rows[ctx.view.req_ids.index(req_id)]
                tokens = ctx.token_ids[row, : ctx.num_tokens[row]].tolist()
                self.proposals.append((req_id, tokens, list(d)))
            return drafts

        # The drafter stays the runner's own (its graphs and buffers too); only its method is wrapped.
        self.drafter.propose = propose

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(Request(req_id, list(prompt), params))
        self.outputs[req_id] = []

    def step(self) -> None:
        out = self.scheduler.schedule()
        self.held.append({r: self.manager.get_block_ids(r) for r in out.num_scheduled_tokens})
        result = self.runner.execute_model(out)
        for res in self.scheduler.update_from_output(out, result):
            self.outputs[res.req_id].extend(res.new_token_ids)
            self.metrics.observe(res.num_draft_tokens, res.num_accepted_tokens)

    def run(self, joins: dict[int, list[tuple[str, list[int], int]]] | None = None) -> dict[str, list[int]]:
        """Step until done; ``joins[step]`` requests are added before that step."""
        joins = joins or {}
        steps = 0
        while self.scheduler.has_unfinished_requests() or steps in joins:
            for req_id, prompt, max_tokens in joins.get(steps, []):
                self.add(req_id, prompt, max_tokens)
            self.step()
            steps += 1
        return self.outputs

    def stray_writes(self) -> list[tuple[str, str, str, int, int]]:
        """(phase, group, request, position, slot) of every recorded slot outside the blocks the
        manager held for the request in that group at that step."""
        strays = []
        for rec in self.runner.kv_write_log.records:
            held = self.held[rec.step - 1]
            slots = rec.slot_mapping.numpy()
            positions = rec.positions.numpy()
            for i, req_id in enumerate(rec.req_ids):
                own = set(held[req_id][rec.group])
                for t in range(rec.query_start_loc[i], rec.query_start_loc[i + 1]):
                    block = int(slots[t]) // BLOCK_SIZE
                    if slots[t] >= 0 and (block == 0 or block not in own):
                        strays.append((rec.phase, rec.group, req_id, int(positions[t]), int(slots[t])))
            assert np.all(slots[rec.query_start_loc[-1] :] == -1)
        return strays


def force_acceptance(rig: SpecRig) -> None:
    """Make the target accept a varying number of each request's drafts (0 .. all) by editing its
    logits, so drafters see partial, full and no acceptance. Target hidden states are untouched."""
    calls = [0]

    def hook(req_ids, num_logits, logits):
        step = rig.runner.last_step
        drafts = {r: d for r, d in zip(step.req_ids, step.draft_token_ids, strict=True)}
        row = 0
        for i, (req_id, n) in enumerate(zip(req_ids, num_logits.tolist(), strict=True)):
            d = drafts[req_id]
            if n and d:
                accept = (calls[0] + i) % (len(d) + 1)
                for j in range(accept):
                    logits[row + j, d[j]] = logits[row + j].max() + 10.0
                if accept < len(d):
                    logits[row + accept, d[accept]] = logits[row + accept].min() - 10.0
            row += n
        calls[0] += 1

    rig.runner.logits_hook = hook
