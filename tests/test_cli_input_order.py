"""Bad input is answered by its cause first: an unsupported architecture before any context-limit
check, and a context too short for warmup named as ``max_model_len`` (not as a full pool).

Each answer is one line with the value seen and what to do, exit 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import BertConfig, GPT2Config
from typer.testing import CliRunner

from warmcap.cli import app
from warmcap.models.registry import supported_architectures

runner = CliRunner()


def _error_line(args: list[str]) -> str:
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1, res.output
    return lines[0]


@pytest.fixture(scope="module")
def foreign_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Config-only GPT-2 (1024 positions) and BERT (512) directories: plan reads no weight."""
    root = tmp_path_factory.mktemp("foreign")
    gpt2 = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, architectures=["GPT2LMHeadModel"])
    bert = BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=128,
        architectures=["BertForMaskedLM"],
    )
    out = {"GPT2LMHeadModel": root / "gpt2", "BertForMaskedLM": root / "bert"}
    gpt2.save_pretrained(out["GPT2LMHeadModel"])
    bert.save_pretrained(out["BertForMaskedLM"])
    return out


@pytest.mark.parametrize("architecture", ["GPT2LMHeadModel", "BertForMaskedLM"])
@pytest.mark.parametrize("max_model_len", [None, "4096"])
def test_an_unsupported_architecture_is_named_before_the_context_limit(
    foreign_models: dict[str, Path], architecture: str, max_model_len: str | None
) -> None:
    # 4096 exceeds both models' limits (1024 and 512); plan's default 1024 exceeds BERT's.
    extra = [] if max_model_len is None else ["--max-model-len", max_model_len]
    line = _error_line(["plan", "--model", str(foreign_models[architecture]), *extra])
    assert f"architecture {architecture!r} is not supported" in line
    assert all(name in line for name in supported_architectures())
    assert "max_model_len" not in line


@pytest.mark.parametrize(("spec", "least"), [("none", 5), ("draft_model:2", 13)])
def test_a_context_too_short_for_warmup_names_max_model_len_and_the_least_that_works(
    spec: str, least: int
) -> None:
    line = _error_line(["plan", "--model", "tiny-llama", "--spec", spec, "--max-model-len", "1"])
    assert line.startswith("error: max_model_len 1 is smaller than")
    assert line.endswith(f"raise --max-model-len to at least {least}")
    assert "pool" not in line
    # the least it names is the least that plans
    below = runner.invoke(
        app, ["plan", "--model", "tiny-llama", "--spec", spec, "--max-model-len", str(least - 1)]
    )
    assert below.exit_code == 2 and f"at least {least}" in below.output
    at = runner.invoke(app, ["plan", "--model", "tiny-llama", "--spec", spec, "--max-model-len", str(least)])
    assert at.exit_code == 0, at.output
