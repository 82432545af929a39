"""SmolLM2-135M (9 query heads, 3 KV heads: split 2 + 1 over two ranks) through ``LLM`` at TP=2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_tp_engine import _run

from warmcap.sampling_params import SamplingParams

PROMPTS_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "bench_prompts.jsonl"
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
OPTIONS = {"max_model_len": 256, "max_num_seqs": 4, "enforce_eager": True}


def _shared_prompts() -> list[str]:
    rows = [json.loads(line) for line in PROMPTS_FILE.read_text().splitlines() if line.strip()]
    general = [r["prompt"] for r in rows if r["kind"] == "general"][:2]
    other = [r["prompt"] for r in rows if r["kind"] != "general"][:1]
    return general + other


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    prompts = _shared_prompts()
    return {tp: _run("smollm2-135m", int(tp[-1]), prompts, PARAMS, **OPTIONS) for tp in ("tp1", "tp2")}


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_tp2_equals_tp1(references):
    one, two = references["tp1"], references["tp2"]
    assert two["tokens"] == one["tokens"]
    torch.testing.assert_close(two["logits"], one["logits"], atol=1e-4, rtol=0)


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_tp2_with_eagle_equals_tp2_without(references):
    out = _run("smollm2-135m", 2, _shared_prompts(), PARAMS, speculative_config="eagle:2", **OPTIONS)
    assert out["drafts"] > 0
    assert out["tokens"] == references["tp2"]["tokens"]
