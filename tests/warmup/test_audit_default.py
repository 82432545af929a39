"""The warmup audit is on by default on every device, and an unaudited start says "audit off" in
every report (text, JSON, ``GET /startup``), never zero counts that read as a clean audit."""

from __future__ import annotations

import json
from dataclasses import replace

import torch
from rich.console import Console
from typer.testing import CliRunner

from warmcap.cli import app
from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, StartupOptions
from warmcap.engine import LLMEngine
from warmcap.graphs.proof.render import render
from warmcap.graphs.proof.report import CaptureReport
from warmcap.llm import LLM
from warmcap.serve.startup_facts import start_engine
from warmcap.startup_hooks import StartupContext
from warmcap.warmup.hook import warmup_hook

RUN = ["run", "--model", "tiny-llama", "--spec", "none", "--max-num-seqs", "1", "--capture-sizes", "1"]


def _config() -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu", enforce_eager=True),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128),
    )


def test_the_default_warmup_audits_on_a_cuda_device_too() -> None:
    """The hook's default no longer depends on the device: a context that says ``cuda`` (the
    runner itself stays on CPU) is audited like any other."""

    def as_if_cuda_hook(ctx: StartupContext):
        return warmup_hook(replace(ctx, device=torch.device("cuda")))

    engine = LLMEngine(_config(), startup_hooks=[as_if_cuda_hook])
    audit = engine.startup_results["as_if_cuda"].audit
    assert audit.enabled and audit.ok
    assert audit.slots_checked > 0 and audit.steps > 0


def test_llm_audits_by_default_and_audit_false_skips_it() -> None:
    kwargs = {
        "device": "cpu",
        "max_model_len": 128,
        "max_num_seqs": 2,
        "num_blocks": 64,
        "enforce_eager": True,
    }
    on = LLM("tiny-llama", **kwargs).engine.warmup_result
    assert on is not None and on.audit.enabled and on.audit.slots_checked > 0
    off = LLM("tiny-llama", audit=False, **kwargs).engine.warmup_result
    assert off is not None and not off.audit.enabled
    assert off.audit.summary() == "audit off: no KV write was checked"


def test_warmup_run_no_audit_says_audit_off_in_text_and_json() -> None:
    runner = CliRunner()
    text = runner.invoke(app, [*RUN, "--no-audit"])
    assert text.exit_code == 0, text.output
    flat = " ".join(text.output.split())
    assert "warmup audit audit off (--no-audit): no KV write was checked" in flat
    assert "0 steps" not in flat and "slots checked" not in flat

    data = json.loads(runner.invoke(app, [*RUN, "--no-audit", "--json"]).stdout)
    audit = data["warmup_audit"]
    assert audit["enabled"] is False
    assert audit["steps"] is None and audit["slots_checked"] is None and audit["violations"] is None
    # The JSON loads back (schema included) as an unaudited report, and renders as one.
    back = CaptureReport.from_dict(data)
    assert not back.warmup_audit.enabled
    console = Console(record=True, width=200)
    render(back, console)
    assert "audit off" in console.export_text()

    default = json.loads(runner.invoke(app, [*RUN, "--json"]).stdout)["warmup_audit"]
    assert default["enabled"] is True and default["slots_checked"] > 0 and default["violations"] == 0


def test_server_startup_report_says_audit_off() -> None:
    started = start_engine(_config(), StartupOptions(audit=False))
    try:
        audit = json.loads(started.report_json)["warmup_audit"]
        assert audit["enabled"] is False and audit["slots_checked"] is None
        assert started.refusal is None
    finally:
        started.engine.shutdown()
    audited = start_engine(_config())
    try:
        assert json.loads(audited.report_json)["warmup_audit"]["enabled"] is True
        assert audited.facts.audit_slots_checked > 0
    finally:
        audited.engine.shutdown()
