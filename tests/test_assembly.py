"""The plan printed is the plan run: ``warmup plan --json`` (meta weights) and a started
``LLMEngine`` (loaded weights) get the same finished config, KV groups, pool size and per-step held
blocks from ``assembly.assemble``, and the same error for a model that states no context limit."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import warmcap.assembly as assembly
import warmcap.engine as engine_module
from warmcap.assembly import assemble, assemble_for_plan, drafter_modules, resident_bytes, weight_bytes
from warmcap.cli import app
from warmcap.drafters import build_drafter
from warmcap.engine import LLMEngine
from warmcap.errors import ConfigError
from warmcap.kv_layout import meta_model
from warmcap.llm import build_config
from warmcap.models.loader import load_hf_config, load_model
from warmcap.models.presets import resolve_model

runner = CliRunner()

# (preset, spec, kv_role, mamba_cache_mode)
CASES = [
    ("tiny-llama", None, "none", "none"),
    ("tiny-llama", "eagle:3", "none", "none"),
    ("tiny-llama", "dflash:7", "none", "none"),
    ("tiny-hybrid", "draft_model:2", "none", "all"),
    ("tiny-deepseek-v3", "mtp:2", "none", "none"),
]
SETTINGS = {"block_size": 16, "max_num_seqs": 2, "max_num_batched_tokens": 32, "max_model_len": 128}


def _llm_kwargs(spec: str | None, role: str, mode: str) -> dict:
    return {
        **SETTINGS,
        "device": "cpu",
        "speculative_config": spec,
        "kv_role": role,
        "mamba_cache_mode": mode,
        "enforce_eager": True,
    }


def _plan_json(model: str, spec: str | None, role: str, mode: str, *extra: str) -> dict:
    args = ["plan", "--model", model, "--spec", spec or "none", "--kv-role", role, "--device", "cpu"]
    args += ["--mamba-cache-mode", mode, "--json", *extra]
    for name, value in SETTINGS.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def _engine_warmup_plan(engine: LLMEngine) -> dict:
    """The plan the engine's warmup hook ran, and proof that its audited run stayed in held blocks."""
    result = engine.warmup_result
    assert result.audit.ok, result.audit.violations[:3]
    return result.plan.to_json()


def _fix_free_memory(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    """The same free memory for the plan and for the engine (measured before its weights load)."""
    monkeypatch.setattr(assembly, "free_memory_bytes", lambda device: free)
    monkeypatch.setattr(engine_module, "free_memory_bytes", lambda device: free)


def _memory_bound_free_bytes(model: str, spec: str | None, role: str, mode: str) -> tuple[int, int]:
    """Free memory that leaves about two thirds of the full-batch pool after the weights; and that
    full-batch pool (the cap)."""
    config = build_config(model, **_llm_kwargs(spec, role, mode))
    roomy = assemble_for_plan(config)  # this host has room for the tiny cap
    meta, _ = meta_model(resolve_model(model, config_only=True), roomy.config)
    weights = resident_bytes(
        roomy.config, torch.device("cpu"), meta, *drafter_modules(build_drafter(roomy.config, meta))
    )
    per_block = sum(g.page_size_bytes for g in roomy.kv_groups)
    target = max(2, 2 * roomy.num_blocks // 3)
    return weights + int(target * per_block / config.cache.memory_fraction) + per_block // 2, roomy.num_blocks


@pytest.mark.parametrize(("model", "spec", "role", "mode"), CASES)
def test_plan_is_the_plan_the_engine_runs(model, spec, role, mode, monkeypatch) -> None:
    free, cap = _memory_bound_free_bytes(model, spec, role, mode)
    _fix_free_memory(monkeypatch, free)
    plan = _plan_json(model, spec, role, mode)
    assert 2 <= plan["num_blocks"] < cap, "the pool is sized by memory here, not by the full-batch cap"
    engine = LLMEngine(build_config(model, **_llm_kwargs(spec, role, mode)))
    assert engine.num_blocks == engine.kv_cache_manager.pool.num_blocks == plan["num_blocks"]
    assert engine.config == assemble_for_plan(engine.config).config
    assert [g.name for g in engine.kv_groups] == [g["name"] for g in plan["kv_groups"]]
    assert _engine_warmup_plan(engine) == plan  # every step, every request, every held block
    # the weights the pool was sized around, by shape: the same on meta as loaded
    meta, _ = meta_model(engine.model_path, engine.config)
    meta_weights = weight_bytes(meta, *drafter_modules(build_drafter(engine.config, meta)))
    assert weight_bytes(engine.model, *drafter_modules(engine.drafter)) == meta_weights


def test_plan_and_engine_agree_when_the_full_batch_caps_the_pool() -> None:
    plan = _plan_json("tiny-llama", "eagle:3", "none", "none")
    engine = LLMEngine(build_config("tiny-llama", **_llm_kwargs("eagle:3", "none", "none")))
    assert engine.num_blocks == plan["num_blocks"]
    assert _engine_warmup_plan(engine) == plan


@pytest.mark.parametrize("spec", ["dflash:7", "eagle:8"])
def test_consumer_seed_cases_plan_the_full_lookahead_and_warm_up_audit_clean(spec: str) -> None:
    """The reference engine's seed bug: a consumer's warmup drafter wrote position 16 into the null
    block. Plan and engine agree, every warmup request reserves the full lookahead, and the audited
    warmup run writes only into blocks each request holds."""
    kwargs = {**_llm_kwargs(spec, "consumer", "none"), "num_blocks": 64}
    plan = _plan_json("tiny-llama", spec, "consumer", "none", "--num-blocks", "64")
    engine = LLMEngine(build_config("tiny-llama", **kwargs))
    lookahead = engine.config.num_lookahead_tokens
    assert lookahead == 8
    assert engine.warmup_result.audit.violations == []
    ran = engine.warmup_result.plan
    assert all(r.num_lookahead_tokens == lookahead for s in ran.steps for r in s.requests)
    assert ran.to_json() == plan


@pytest.fixture
def model_without_context_limit(tmp_path: Path) -> Path:
    """tiny-llama whose config.json states no context limit (transformers fills a default for a
    missing key, and refuses null, so the checkpoint says 0)."""
    out = tmp_path / "no-limit"
    shutil.copytree(resolve_model("tiny-llama"), out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = 0
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_unknown_context_limit_is_the_same_clear_error_in_engine_and_plan(
    model_without_context_limit: Path,
) -> None:
    with pytest.raises(ConfigError) as exc:
        LLMEngine(build_config(str(model_without_context_limit), device="cpu"))
    message = str(exc.value)
    assert "max_position_embeddings" in message and "--max-model-len" in message
    res = runner.invoke(app, ["plan", "--model", str(model_without_context_limit), "--max-model-len", "auto"])
    assert res.exit_code == 2
    assert "Traceback" not in res.output
    assert " ".join(res.output.split()) == " ".join(f"error: {message}".split())


def test_smollm2_plan_from_its_config_alone_equals_assembly_over_its_loaded_weights(monkeypatch) -> None:
    config = build_config("smollm2-135m", device="cpu", max_num_seqs=8)
    path = resolve_model("smollm2-135m")
    hf_config = load_hf_config(path)
    model = load_model(path, device="cpu")
    weights = resident_bytes(config, torch.device("cpu"), model)
    per_block = sum(g.page_size_bytes for g in assemble_for_plan(config.with_max_model_len(16)).kv_groups)
    _fix_free_memory(monkeypatch, weights + 300 * per_block)
    planned = assemble_for_plan(config)
    loaded = assemble(
        config,
        hf_config,
        model,
        None,
        device=assembly.resolve_device("cpu"),
        free_bytes=weights + 300 * per_block,
    )
    assert planned == loaded
    assert planned.config.max_model_len == hf_config.max_position_embeddings
    assert planned.num_blocks == int(300 * per_block * config.cache.memory_fraction) // per_block


@pytest.mark.usefixtures("screen_on_every_cpu")
def test_kv_sizing_counts_the_screened_greedy_head_the_runner_builds(monkeypatch) -> None:
    """The pool is sized around the target's screened head (``models/greedy_head.py``): the bytes
    counted for a model on the meta device are the bytes the loaded engine's head holds."""
    config = build_config("tiny-llama", device="cpu", max_num_seqs=4)
    engine = LLMEngine(config)
    head = engine.runner.greedy_head
    assert head is not None
    meta, _ = meta_model(engine.model_path, engine.config)
    cpu = torch.device("cpu")
    counted = resident_bytes(engine.config, cpu, meta)
    assert counted == resident_bytes(engine.config, cpu, engine.model)
    off = replace(engine.config, kernel=replace(engine.config.kernel, exact_greedy_head="off"))
    assert counted - resident_bytes(off, cpu, meta) == head.nbytes > 0
    engine.shutdown()


def test_plan_serve_is_the_audited_warmup_a_server_runs_at_default_flags() -> None:
    """`warmup serve`'s defaults on CPU (128 sequences, 2048 tokens a step, the fixed KV space,
    eager): `warmup plan --serve` prints the warmup the server's engine runs, and its audited run
    stays inside the blocks each request holds."""
    res = runner.invoke(app, ["plan", "--serve", "--model", "tiny-llama", "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    config = build_config(
        "tiny-llama", device="cpu", max_num_seqs=128, max_num_batched_tokens=2048, enforce_eager=True
    )
    engine = LLMEngine(config)
    assert engine.num_blocks == plan["num_blocks"]
    assert _engine_warmup_plan(engine) == plan
    assert engine.config.scheduler.max_num_seqs == 128 and plan["steps"]
    engine.shutdown()
