"""One capture plan: the facts ``warmup plan`` reads from a config, its KV groups and its drafter
with no runner are the facts capture reads from the runner start-up builds, so the plan is one."""

from __future__ import annotations

import pytest

from warmcap.assembly import assemble_for_plan, resolve_device
from warmcap.engine import LLMEngine
from warmcap.engine_args import build_config
from warmcap.graphs.capture.capturer import planned_capture
from warmcap.graphs.capture.planning import CaptureFacts, plan_capture


@pytest.mark.parametrize(
    ("model", "spec"),
    [
        # k=2 and 8 sequences: a full decode step (24 tokens) exceeds the 16-token step budget,
        # so the runner's buffers are sized by the decode step, not the budget
        ("tiny-llama", "draft_model:2"),
        ("tiny-llama", "eagle3:2"),
        ("tiny-hybrid", "ngram:2"),
    ],
)
def test_a_config_and_its_runner_give_capture_the_same_facts_and_plan(model: str, spec: str) -> None:
    config = build_config(
        model,
        device="cpu",
        speculative_config=spec,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        max_model_len=128,
        num_blocks=64,
    )
    engine = LLMEngine(config, startup_hooks=[])
    runner = engine.runner
    assembly = assemble_for_plan(config)
    draft_model = None if assembly.drafter is None else assembly.drafter.draft_model
    facts = CaptureFacts.of_config(assembly.config, assembly.kv_groups, runner.attn_backend, draft_model)
    assert facts == CaptureFacts.of_runner(runner)
    assert facts.max_num_tokens == 24
    for backend in ("static", "cuda"):
        planned = planned_capture(
            assembly.config, assembly.kv_groups, draft_model, device=resolve_device("cpu"), backend=backend
        )
        assert planned == plan_capture(CaptureFacts.of_runner(runner), backend=backend)
    engine.shutdown()
