"""Presets resolve to cached HF directories; SmolLM2 converts and matches transformers."""

from __future__ import annotations

import json

import pytest
import torch

from warmcap.errors import ModelLoadError
from warmcap.models.loader import load_hf_config, load_model, load_tokenizer
from warmcap.models.presets import PRESETS, preset_dir, resolve_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMCAP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_unknown_name_lists_presets(cache):
    with pytest.raises(ModelLoadError, match=r"tiny-llama.*smollm2|smollm2.*tiny-llama"):
        resolve_model("no-such-model")


def test_existing_directory_resolves_to_itself(tmp_path, cache):
    assert resolve_model(tmp_path) == tmp_path


def test_tiny_preset_is_built_once_and_deterministic(cache):
    path = resolve_model("tiny-llama")
    assert path == preset_dir("tiny-llama") and path.is_relative_to(cache)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny-llama") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    first = load_model(path).state_dict()
    # A second cache rebuilt from scratch gives the same weights and tokenizer.
    other = cache.parent / "cache2"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WARMCAP_CACHE", str(other))
        again = resolve_model("tiny-llama")
    assert again != path
    second = load_model(again).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert (path / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()
    assert load_tokenizer(path).chat_template


def test_config_only_writes_no_weights(cache):
    path = resolve_model("tiny-qwen3", config_only=True)
    assert sorted(p.name for p in path.iterdir()) == ["config.json"]
    config = load_hf_config(path)
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 3


def test_config_only_reuses_a_full_build(cache):
    full = resolve_model("tiny-qwen2")
    assert resolve_model("tiny-qwen2", config_only=True) == full


def test_every_preset_name_is_listed():
    assert set(PRESETS) >= {"smollm2-135m", "tiny-llama", "tiny-qwen3", "tiny-mistral", "tiny-qwen2"}


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_converts_loads_and_matches_transformers_greedy(harness_cls):
    from transformers import AutoModelForCausalLM

    path = resolve_model("smollm2-135m")
    ours = load_model(path)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = load_tokenizer(path)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
    ids = [tok(t).input_ids for t in texts]
    generated, _ = harness_cls(ours).greedy(ids, 32)
    for prompt, got in zip(ids, generated, strict=True):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None)
        assert got == out[0, len(prompt) :].tolist()
    assert "Paris" in tok.decode(generated[0])


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_directory_is_plain_hf_with_the_gguf_logits(cache):
    """Another engine reads config.json: no GGUF quantization_config may remain over fp32 weights,
    and transformers must read the directory into the same model as the GGUF file itself."""
    from transformers import AutoModelForCausalLM

    from warmcap.models.presets import smollm2_gguf

    path = resolve_model("smollm2-135m")
    assert path.name.endswith("-v2")
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]

    gguf = smollm2_gguf()
    source = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
    ).eval()
    clean = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert getattr(clean.config, "quantization_config", None) is None
    ids = torch.tensor([load_tokenizer(path)("The capital of France is").input_ids])
    with torch.no_grad():
        assert torch.equal(clean(ids).logits, source(ids).logits)
