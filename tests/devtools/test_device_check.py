"""The body of ``scripts/gpu_check.py`` on CPU: the same checks, ``static`` graphs, tiny presets.

A method the checks call that was renamed, or a check that stopped passing on the engine path,
fails here instead of on the next GPU session (an H200 run once found the script crashing on every
engine with ``'GraphCapturer' object has no attribute 'eager'``)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from warmcap.devtools.device_check import (
    CHECKS,
    CheckContext,
    EngineCase,
    check,
    out_path,
    run_checks,
    summary_lines,
)

ROOT = Path(__file__).resolve().parents[2]
CASES = (
    EngineCase("tiny-llama", "float32", "draft_model:2"),
    EngineCase("tiny-hybrid", "float32", "ngram:2"),
)


def _cpu_context(**kw) -> CheckContext:
    return CheckContext(
        device=torch.device("cpu"),
        engines=CASES,
        # The GPU's plan, captured with the static backend: the hybrid gets only what cuda records.
        plan_backend="cuda",
        capture_sizes=[4],
        max_num_seqs=2,
        max_num_batched_tokens=32,
        max_model_len=128,
        num_blocks=64,
        max_tokens=8,
        timing_iters=1,
        audit_case=EngineCase("tiny-llama", "float32"),
        **kw,
    )


@pytest.mark.slow
def test_gpu_checks_pass_on_cpu_with_static_graphs(tmp_path, monkeypatch) -> None:
    results = run_checks(_cpu_context())
    lines = summary_lines(results)
    assert results["ok"], "\n".join(lines)
    assert list(results["checks"]) == list(CHECKS)

    engines = {e["engine"]: e for e in results["checks"]["engines"]["engines"]}
    llama, hybrid = engines[CASES[0].label], engines[CASES[1].label]
    for e in (llama, hybrid):
        assert e["all_verified"] and e["generation_identical"] and e["graph_replays_during_generation"] > 0
        timed = {t["phase"] for t in e["replay_vs_eager"]}
        assert all(t["replay_ms"] > 0 and t["eager_ms"] > 0 for t in e["replay_vs_eager"])
    assert llama["draft_graph_replays_during_generation"] > 0
    assert {"decode", "mixed", "draft_prefill", "draft_decode"} <= {
        t["phase"] for t in llama["replay_vs_eager"]
    }
    assert timed == {"decode"}  # the hybrid's cuda plan: uniform decode graphs only

    # CUDA-only checks say why they did not run; the audit's cost is measured both ways.
    assert results["checks"]["slot_mapping"]["skipped"].startswith("needs CUDA")
    cost = results["checks"]["audit_cost"]
    assert cost["audit"]["slots_checked"] > 0 and cost["audit"]["violations"] == 0
    assert cost["no_audit"]["audit_enabled"] is False and cost["no_audit"]["slots_checked"] is None
    assert any(line.startswith("PASS  audit_cost") for line in lines)
    # One step in flight gives the synchronous tokens; on CPU the default stays synchronous.
    flight = results["checks"]["async_scheduling"]
    assert flight["tokens_identical"] and flight["default_is_async"] is False

    monkeypatch.setenv("OUT", str(tmp_path))
    written = json.loads(Path(out_path(results)).read_text())
    assert written["checks"]["engines"]["ok"] is True


def test_a_failing_check_fails_alone_and_names_its_error(monkeypatch) -> None:
    monkeypatch.setattr("warmcap.devtools.device_check.registry.CHECKS", dict(CHECKS))

    @check("always_broken")
    def always_broken(ctx: CheckContext) -> dict:
        raise AttributeError("'GraphCapturer' object has no attribute 'eager'")

    with pytest.raises(ValueError, match="registered twice"):
        check("always_broken")(always_broken)
    results = run_checks(_cpu_context(), ["slot_mapping", "always_broken"])
    assert not results["ok"]
    assert results["checks"]["slot_mapping"]["ok"]
    assert "no attribute 'eager'" in results["checks"]["always_broken"]["error"]
    assert "FAIL  always_broken" in "\n".join(summary_lines(results))
    with pytest.raises(ValueError, match="unknown device check"):
        run_checks(_cpu_context(), ["no_such_check"])


def test_the_script_refuses_to_run_without_cuda(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["gpu_check.py"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "scripts" / "gpu_check.py"), run_name="__main__")
    assert exit_.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().out
