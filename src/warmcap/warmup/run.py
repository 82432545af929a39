"""Execute a warmup plan on the runner with every KV write audited, then scrub (invariant I3).

The plan's block ids come from a scratch pool identical to the engine's untouched pool, so running
it writes KV only into blocks production has not handed out yet. Afterwards every block the plan
used is zeroed (the sink too), the runner's rows are released, the sampler's RNG is rewound, and
the engine pool is checked against its snapshot from before warmup.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from warmcap.audit.kv_writes import AuditResult, audit_records
from warmcap.core.outputs import SchedulerOutput
from warmcap.errors import WarmcapError

if TYPE_CHECKING:
    from warmcap.core.kv_cache_manager import KVCacheManager
    from warmcap.runner_v2.kv_writes import KVWriteRecord
    from warmcap.runner_v2.model_runner import ModelRunner
    from warmcap.warmup.plan import WarmupPlan


class WarmupTraceError(WarmcapError):
    """Warmup left state behind (pool, persistent batch or KV tensors differ from before)."""


@dataclass(frozen=True, slots=True)
class BatchSnapshot:
    """What a clean persistent batch looks like: no live rows, no block-table or token residue."""

    live_rows: tuple[str, ...]
    nonzero_block_table_entries: int
    nonzero_tokens: int

    @classmethod
    def of(cls, runner: ModelRunner) -> BatchSnapshot:
        batch = runner.batch
        tables = sum(
            int((batch.block_tables[g].gather(range(batch.max_num_reqs)) != 0).sum())
            for g in batch.block_tables.group_names
        )
        return cls(tuple(sorted(batch.row_of)), tables, int((batch.token_ids != 0).sum()))


@dataclass(slots=True)
class WarmupResult:
    """What warmup did, how long it took and what the audit found."""

    plan: WarmupPlan
    audit: AuditResult
    seconds: dict[str, float] = field(default_factory=dict)
    used_blocks: list[int] = field(default_factory=list)
    num_passes: int = 0
    #: per plan step, the passes the audit checked (empty without the audit): what each pass wrote
    #: where, for the report page (``warmcap.pages``)
    step_writes: list[list[KVWriteRecord]] = field(default_factory=list)


def used_block_ids(plan: WarmupPlan) -> list[int]:
    """Every real block id any planned request held at any step (null placeholders excluded)."""
    ids = {b for s in plan.steps for r in s.requests for blocks in r.blocks.values() for b in blocks}
    ids.discard(0)
    return sorted(ids)


def run_warmup(
    runner: ModelRunner,
    manager: KVCacheManager,
    plan: WarmupPlan,
    *,
    audit: bool = True,
    before_scrub: Callable[[ModelRunner, list[int]], None] | None = None,
    on_step: Callable[[int, int, str], None] | None = None,
) -> WarmupResult:
    """Run ``plan`` step by step on ``runner``, auditing each step's KV writes, then scrub.

    ``manager`` is the engine's allocator; it must be untouched (warmup runs before serving).
    ``before_scrub`` is a test seam that may dirty the used blocks to prove the scrub works.
    ``on_step(done, total, name)`` is called after each step (start-up progress).
    """
    pool_before = manager.pool.snapshot()
    if manager.pool.num_free_blocks != manager.pool.num_blocks - 1:
        raise WarmcapError(
            f"warmup must run before serving: {manager.pool.num_blocks - 1 - manager.pool.num_free_blocks} "
            "blocks are in use. Call it from start-up, or finish every request first."
        )
    batch_before = BatchSnapshot.of(runner)
    rng_state = runner.sampler.generator.get_state() if runner.sampler.generator is not None else None
    block_sizes = {g.name: g.spec.block_size for g in plan.kv_groups}
    result = WarmupResult(plan=plan, audit=AuditResult(enabled=audit), used_blocks=used_block_ids(plan))

    t0 = time.perf_counter()
    try:
        with runner.recording_kv_writes(audit) as log:
            for i, step in enumerate(plan.steps):
                log.clear()
                runner.execute_model(step.scheduler_output)
                result.num_passes += len(log)
                if audit:
                    held = {r.req_id: r.blocks for r in step.requests}
                    result.audit.merge(audit_records(step.name, log.records, held, block_sizes))
                    result.step_writes.append(list(log.records))
                if on_step is not None:
                    on_step(i + 1, len(plan.steps), step.name)
    finally:
        runner.kv_write_log.clear()
        runner.execute_model(SchedulerOutput(finished_req_ids=set(plan.req_ids)))
    result.seconds["execute"] = time.perf_counter() - t0

    if before_scrub is not None:
        before_scrub(runner, result.used_blocks)
    t1 = time.perf_counter()
    scrub(runner, result.used_blocks)
    if rng_state is not None:
        runner.sampler.generator.set_state(rng_state)
    result.seconds["scrub"] = time.perf_counter() - t1
    _check_no_trace(manager, runner, pool_before, batch_before)
    return result


def scrub(runner: ModelRunner, used_blocks: list[int]) -> None:
    """Zero the KV (and state) of ``used_blocks`` and the PAD sink in every layer, the drafter's
    groups included (they live in the runner's caches)."""
    sink = runner.kv_caches.num_blocks
    runner.kv_caches.zero_blocks([*used_blocks, sink])
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def _check_no_trace(manager, runner, pool_before, batch_before) -> None:
    problems = pool_before.differences(manager.pool.snapshot())
    batch_after = BatchSnapshot.of(runner)
    if batch_after != batch_before:
        problems.append(f"persistent batch differs: before {batch_before}, after {batch_after}")
    if problems:
        raise WarmupTraceError("warmup left a trace: " + "; ".join(problems))
