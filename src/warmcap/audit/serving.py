"""The KV-write audit while serving (``audit_serving``): warmup's record check on every step.

Each step runs with the runner's KV-write log on; afterwards every recorded pass (target and
drafter, eager or replayed) is checked against the blocks the allocator holds for each request at
that step, and the log is cleared so memory stays bounded by one step. A violation raises
:class:`AuditViolationError` naming request, group, position, slot and block; the engine then
aborts that step's requests and frees their blocks as for any failing step (``engine.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from warmcap.audit.kv_writes import AuditResult, AuditViolationError, audit_records

if TYPE_CHECKING:
    from warmcap.core.kv_cache_manager import KVCacheManager
    from warmcap.core.kv_spec import KVCacheGroup
    from warmcap.runner_v2.model_runner import ModelRunner


@dataclass(slots=True)
class ServingAudit:
    """Audits every serving step of one engine; ``totals`` accumulates the clean steps' counts."""

    runner: ModelRunner
    manager: KVCacheManager
    block_sizes: dict[str, int]
    totals: AuditResult = field(default_factory=AuditResult)
    _steps: int = 0

    @classmethod
    def of(cls, runner: ModelRunner, manager: KVCacheManager, kv_groups: list[KVCacheGroup]) -> ServingAudit:
        return cls(runner, manager, {g.name: g.spec.block_size for g in kv_groups})

    @contextmanager
    def step(self) -> Iterator[None]:
        """Record the passes run inside; on a clean exit audit them (raising on a stray write).
        The log is empty again afterwards either way."""
        self._steps += 1
        log = self.runner.kv_write_log
        log.clear()
        try:
            with self.runner.recording_kv_writes(True):
                yield
            req_ids = {r for rec in log.records for r in rec.req_ids}
            held = {r: self.manager.get_block_ids(r) for r in req_ids}
            result = audit_records(f"serving-{self._steps}", log.records, held, self.block_sizes)
        finally:
            log.clear()
        if not result.ok:
            raise AuditViolationError(
                f"serving audit (step {self._steps}) found {result.describe()}; the step's requests "
                "were aborted and their blocks freed. This is a warmcap bug in block reservation or "
                "slot mapping: report it with the model, the options and the prompts"
            )
        self.totals.merge(result)


@dataclass(frozen=True, slots=True)
class ServingAuditCounts:
    """The serving audit so far: steps audited, KV slots checked in the clean ones, and steps it
    failed (a stray write ends its step's requests)."""

    steps: int
    slots_checked: int
    violations: int

    def to_json(self) -> dict[str, int]:
        return {"steps": self.steps, "slots_checked": self.slots_checked, "violations": self.violations}
