"""Test doubles for the scheduling core: a fake runner with random acceptance and spec builders."""

from __future__ import annotations

import random

from warmcap.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from warmcap.core.kv_cache_manager import KVCacheManager
from warmcap.core.kv_spec import FullAttentionSpec, KVCacheGroup
from warmcap.core.outputs import ModelRunnerOutput, SchedulerOutput
from warmcap.core.request import Request
from warmcap.core.scheduler import Scheduler
from warmcap.sampling_params import SamplingParams

VOCAB = 50


class FakeRunner:
    """Plays the model: samples random tokens (EOS possible), accepts a random prefix of the
    drafts and proposes random drafts (sometimes fewer than k, sometimes none)."""

    def __init__(self, rng: random.Random, k: int, *, eos_token_id: int | None = None) -> None:
        self.rng = rng
        self.k = k
        self.eos = eos_token_id
        # req_id -> total tokens (prompt + outputs) the runner believes the request has
        self.seen: dict[str, int] = {}

    def token(self) -> int:
        return self.rng.randrange(VOCAB)

    def execute(self, sched: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        drafts: dict[str, list[int]] = {}
        for req_id in req_ids:
            req = sched.requests[req_id]
            if req.num_computed_tokens < req.num_tokens:
                sampled.append([])  # a prompt chunk that does not reach the prompt's end
                continue
            scheduled = out.scheduled_spec_decode_tokens.get(req_id, [])
            accepted = self.rng.randint(0, len(scheduled))
            sampled.append([*scheduled[:accepted], self.token()])
            if self.k:
                drafts[req_id] = [self.token() for _ in range(self.rng.randint(0, self.k))]
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, draft_token_ids=drafts)


def full_groups(block_size: int = 16) -> list[KVCacheGroup]:
    return [KVCacheGroup("full", FullAttentionSpec(block_size=block_size))]


def make_scheduler(
    *,
    spec: str | None = None,
    num_blocks: int = 64,
    block_size: int = 16,
    max_model_len: int = 256,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    chunked_prefill: bool = True,
    enable_caching: bool | None = None,
    kv_role: str = "none",
    groups: list[KVCacheGroup] | None = None,
    eos_token_id: int | None = None,
    async_scheduling: bool = False,
    max_prefill_tokens_with_decodes: int | None = None,
) -> Scheduler:
    config = EngineConfig(
        cache=CacheConfig(block_size=block_size, enable_prefix_caching=enable_caching),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked_prefill,
            async_scheduling=async_scheduling,
            max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
        ),
        speculative=SpeculativeConfig.parse(spec),
        kv_role=kv_role,
    )
    kv = KVCacheManager(
        groups or full_groups(block_size),
        num_blocks,
        max_model_len=max_model_len,
        enable_caching=enable_caching,
    )
    return Scheduler(config, kv, eos_token_id=eos_token_id)


def make_request(req_id: str, prompt: list[int], max_tokens: int = 16, **params: object) -> Request:
    return Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params))


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 2000) -> list[SchedulerOutput]:
    """Drive schedule/execute/update until nothing is left; returns every step's output."""
    outputs: list[SchedulerOutput] = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        outputs.append(out)
        sched.update_from_output(out, runner.execute(sched, out))
        assert len(outputs) < max_steps, "scheduler made no progress"
    return outputs
