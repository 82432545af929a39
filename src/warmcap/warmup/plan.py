"""The warmup plan as data: steps of real scheduler outputs, each request's blocks, the JSON view."""

from __future__ import annotations

from dataclasses import dataclass, field

from warmcap.core.kv_spec import KVCacheGroup
from warmcap.core.outputs import SchedulerOutput


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request in one step, with every block it holds per group at that step."""

    req_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_spec_tokens: int
    num_lookahead_tokens: int
    blocks: dict[str, list[int]]
    # group -> "tokens" (scheduled tokens entered a new block) or "lookahead" (only the drafter's
    # lookahead did: the boundary a plan built without lookahead would miss)
    crossed: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class WarmupStep:
    """A named, explained step and the exact scheduler output the runner will execute."""

    name: str
    kind: str
    reason: str
    scheduler_output: SchedulerOutput
    requests: list[PlannedRequest]


@dataclass(frozen=True, slots=True)
class SkippedStep:
    name: str
    reason: str


@dataclass(slots=True)
class WarmupPlan:
    """Ordered warmup steps plus everything needed to check or print them."""

    model: str
    method: str | None
    num_speculative_tokens: int
    block_size: int
    max_model_len: int
    num_lookahead_tokens: int
    num_blocks: int
    kv_groups: list[KVCacheGroup]
    steps: list[WarmupStep] = field(default_factory=list)
    skipped: list[SkippedStep] = field(default_factory=list)

    @property
    def req_ids(self) -> list[str]:
        seen: dict[str, None] = {}
        for step in self.steps:
            for r in step.requests:
                seen.setdefault(r.req_id)
        return list(seen)

    def to_json(self) -> dict:
        """The stable schema of ``schemas/warmup_plan.schema.json`` (documented in docs/warmup.md)."""
        return {
            "model": self.model,
            "spec": {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens},
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "num_lookahead_tokens": self.num_lookahead_tokens,
            "num_blocks": self.num_blocks,
            "kv_groups": [_group_json(g) for g in self.kv_groups],
            "steps": [
                {
                    "name": s.name,
                    "kind": s.kind,
                    "requests": [
                        {
                            "req_id": r.req_id,
                            "num_computed_tokens": r.num_computed_tokens,
                            "num_scheduled_tokens": r.num_scheduled_tokens,
                            "num_spec_tokens": r.num_spec_tokens,
                            "blocks": r.blocks,
                        }
                        for r in s.requests
                    ],
                }
                for s in self.steps
            ],
        }


def _group_json(group: KVCacheGroup) -> dict:
    out: dict = {"name": group.name, "kind": group.spec.kind, "block_size": group.spec.block_size}
    cache_mode = getattr(group.spec, "cache_mode", None)
    if cache_mode is not None:
        out["cache_mode"] = cache_mode
    return out
