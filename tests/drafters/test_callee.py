"""A drafter is a callee: it proposes from the context it is handed, runs its passes through the
draft executor it was bound to, and never calls back into the runner.

The call-graph test watches real steps of every method (and of drafter graphs replayed) with
``sys.setprofile`` and checks, on every stack: no frame of ``model_runner.py`` is entered below a
drafter or draft-executor frame; no call into the drafter's side is handed an object with a way
into the runner; and on a stack through the drafter's side, none of the step's collaborators
(runner, drafter, executor, draft model, graph dispatcher) appears twice with another between.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest
import torch
from spec_rig import TINY_VOCAB, SpecRig, prompts

import warmcap
from warmcap.config import EngineConfig, SpeculativeConfig
from warmcap.drafters.ngram import NgramDrafter
from warmcap.runner_v2.draft_context import DraftContext, StepView
from warmcap.runner_v2.model_runner import ModelRunner

PACKAGE = Path(warmcap.__file__).parent
DRAFTERS = PACKAGE / "drafters"
EXECUTOR = PACKAGE / "runner_v2" / "draft_executor.py"
RUNNER = str(PACKAGE / "runner_v2" / "model_runner.py")
#: ways back into the runner a drafter must never be handed
RUNNER_ENTRIES = ("run_draft_pass", "execute_model", "run_pass")
DRAFT_SIDE = {"drafter", "executor", "draft model"}


def _ngram_context(max_model_len: int) -> DraftContext:
    # Two requests in persistent-batch rows 4 and 1; row 4 ends in a suffix seen before.
    token_ids = np.zeros((6, 32), dtype=np.int64)
    token_ids[4, :9] = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    token_ids[1, :4] = [1, 2, 3, 4]
    num_tokens = np.zeros(6, dtype=np.int32)
    num_tokens[4], num_tokens[1] = 9, 4
    view = StepView(
        req_ids=["a", "b"],
        rows=np.array([4, 1]),
        start=np.array([8, 3]),
        num_valid=np.array([0, 0]),
        sampled=np.array([True, True]),
        token_offset=np.array([0, 1]),
    )
    return DraftContext(
        view=view,
        hidden_states=torch.zeros(2, 8),
        aux_hidden_states=[],
        token_ids=token_ids,
        num_tokens=num_tokens,
        device=torch.device("cpu"),
        max_model_len=max_model_len,
    )


def test_ngram_drafts_from_a_hand_built_context_alone() -> None:
    k = 3
    drafter = NgramDrafter(EngineConfig(speculative=SpeculativeConfig.parse(f"ngram:{k}")))
    drafts = drafter.propose(_ngram_context(32))
    # On the device, one row per request that drafted, -1 past its drafts; positions follow the
    # sampled token at position 8.
    assert drafts.req_ids == ["a"] and drafts.num_drafts.tolist() == [3]
    assert drafts.token_ids.tolist() == [[8, 9, 1]]
    assert drafts.positions.tolist() == [[9, 10, 11]]
    assert drafts.to_lists() == {"a": [8, 9, 1]}
    # The length cap reaches the drafter through the context: one slot before max_model_len - 1.
    capped = drafter.propose(_ngram_context(10))
    assert capped.to_lists() == {"a": [8]} and capped.positions.tolist() == [[9, -1, -1]]


def test_no_drafter_module_names_the_runner_or_a_way_into_it() -> None:
    assert not hasattr(ModelRunner, "run_draft_pass")
    named = []
    for path in [*sorted(DRAFTERS.rglob("*.py")), EXECUTOR]:
        source = path.read_text()
        if "ModelRunner" in source or "runner_v2.model_runner" in source:
            named.append(f"{path.name}: ModelRunner")
        for node in ast.walk(ast.parse(source)):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
            if name in RUNNER_ENTRIES:
                named.append(f"{path.name}:{node.lineno} {name}")
    assert named == []


class CallStackWatch:
    """Watches calls under ``sys.setprofile``; ``problems`` lists every re-entry it saw."""

    def __init__(self, runner: ModelRunner) -> None:
        drafter = runner.drafter
        parts: dict[str, Any] = {"runner": runner, "drafter": drafter, "executor": runner.draft_executor}
        parts["draft model"] = getattr(drafter, "draft_model", None)
        parts["graphs"] = runner.graphs
        self.names = {id(v): k for k, v in parts.items() if v is not None}
        self.problems: list[str] = []
        self.handed: list[str] = []
        self.drafter_calls = 0

    def _callee_frame(self, frame: FrameType) -> bool:
        f = frame.f_code.co_filename
        return f.startswith(str(DRAFTERS)) or f == str(EXECUTOR)

    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        code = frame.f_code
        if self._callee_frame(frame):
            self.drafter_calls += 1
            # What a drafter or executor call is handed: never a way into the runner.
            for name, value in frame.f_locals.items():
                if any(hasattr(type(value), entry) for entry in RUNNER_ENTRIES):
                    self.handed.append(f"{code.co_name}({name}={type(value).__name__})")
        if code.co_filename == RUNNER:
            f = frame.f_back
            while f is not None:
                if self._callee_frame(f):
                    self.problems.append(f"{f.f_code.co_name} -> ModelRunner.{code.co_name}")
                    break
                f = f.f_back
        me = self.names.get(id(frame.f_locals.get("self")))
        if me is None:
            return
        chain = [me]
        f = frame.f_back
        while f is not None:
            owner = self.names.get(id(f.f_locals.get("self")))
            if owner is not None and owner != chain[-1]:
                chain.append(owner)
            f = f.f_back
        # NOTE: only stacks through the drafter's side: on CPU a target graph's replay is the
        # runner's own eager forward (runner <- graphs <- runner), which is the target's business.
        if len(set(chain)) != len(chain) and DRAFT_SIDE & set(chain):
            self.problems.append(" <- ".join(chain))

    @contextmanager
    def watching(self) -> Iterator[CallStackWatch]:
        sys.setprofile(self._profile)
        try:
            yield self
        finally:
            sys.setprofile(None)


def _steps(rig: SpecRig, steps: int) -> None:
    ps = prompts(TINY_VOCAB, (14, 5), seed=2, repetitive=True)
    rig.add("a", ps[0], 8)
    rig.add("b", ps[1], 8)
    for _ in range(steps):
        rig.step()


@pytest.mark.parametrize("spec", ["ngram:3", "draft_model:2", "eagle:2", "eagle3:2", "mtp:2", "dflash:2"])
def test_no_call_path_leads_from_a_drafter_back_into_the_runner(spec: str) -> None:
    rig = SpecRig(spec=spec, record=True)
    watch = CallStackWatch(rig.runner)
    with watch.watching():
        _steps(rig, 6)
    # The drafter ran its passes and drafted (ngram too: the 14-token prompt repeats a motif).
    assert rig.proposals and watch.drafter_calls > 0
    assert watch.problems == [] and watch.handed == []


def test_replayed_drafter_graphs_do_not_call_back_either() -> None:
    from warmcap.graphs.startup import capture_graphs

    rig = SpecRig(spec="draft_model:2", record=True)
    capture_graphs(rig.runner, rig.manager, backend="static", capture_sizes=[4, 8], verify=False)
    graphs = rig.runner.graphs
    assert graphs is not None
    watch = CallStackWatch(rig.runner)
    with watch.watching():
        _steps(rig, 6)
    assert sum(graphs.draft_replays.values()) > 0
    assert watch.problems == [] and watch.handed == []
    # Replayed passes are logged like eager ones: the audit still sees every drafter write.
    assert rig.stray_writes() == []
    assert {"draft_prefill", "draft_step_1"} <= {rec.phase for rec in rig.runner.kv_write_log.records}


def test_the_watch_sees_a_drafter_that_calls_back() -> None:
    """The check can fail: a drafter handed a way back (as ``ctx.run_pass`` once was) is caught."""
    rig = SpecRig(spec="eagle:2", record=False)
    runner = rig.runner
    honest = rig.drafter.propose

    def calls_back(ctx: DraftContext):
        runner.state_metadata({})  # re-enters the runner from inside the drafter's frame
        return honest(ctx)

    # Defined here, so mark it as a drafter frame the way the watch knows them: by file.
    watch = CallStackWatch(runner)
    watch._callee_frame = lambda frame: (
        frame.f_code is calls_back.__code__
        or (  # type: ignore[method-assign]
            CallStackWatch._callee_frame(watch, frame)
        )
    )
    rig.drafter.propose = calls_back
    with watch.watching():
        _steps(rig, 2)
    assert any("ModelRunner.state_metadata" in p for p in watch.problems)
