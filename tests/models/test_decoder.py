"""The shared causal-LM shell (``models/decoder.py``) as each family loads through it: a checkpoint
saved with tied embeddings, against transformers on the same files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from paged_harness import PagedHarness, hf_last_logits, hf_model
from safetensors.torch import load_file, save_file

from warmcap.models.loader import load_model
from warmcap.models.presets_extra import make_tiny_deepseek_v3, make_tiny_hybrid
from warmcap.models.tiny import write_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12]
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"

#: one builder per family with its own load path (Llama-family names, DeepSeek's experts and MTP
#: layer, Bamba's Mamba layers)
FAMILIES: dict[str, Callable[[Path], None]] = {
    "llama": lambda out: write_tiny_model("tiny-llama", out),
    "deepseek-v3": make_tiny_deepseek_v3,
    "bamba": make_tiny_hybrid,
}


def tied_copy(source: Path, out: Path, *, stored: str) -> Path:
    """``source`` re-saved as a tied checkpoint that stores the shared matrix under ``stored`` only
    (transformers writes the embedding's name; some exporters keep the head's)."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(config))
    state = load_file(str(out / "model.safetensors"))
    shared = state.pop(EMBEDDING)
    del state[HEAD]
    state[stored] = shared
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def last_logits(model: torch.nn.Module) -> torch.Tensor:
    return PagedHarness(model, model.kv_layer_specs(4)).step([("a", PROMPT, 0)])[-1]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tied_checkpoint_loads_with_the_head_sharing_the_embedding(family: str, tmp_path: Path) -> None:
    source = tmp_path / "untied"
    FAMILIES[family](source)
    tied = tied_copy(source, tmp_path / "tied", stored=EMBEDDING)
    ours = load_model(tied)
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    got = last_logits(ours)
    diff = (got - hf_last_logits(hf_model(tied), PROMPT)).abs().max().item()
    assert diff <= 1e-4, f"max |diff| {diff} against transformers"
    # The same matrix stored under the head's name gives the same model.
    by_head = load_model(tied_copy(source, tmp_path / "by-head", stored=HEAD))
    assert by_head.lm_head.weight.data_ptr() == by_head.model.embed_tokens.weight.data_ptr()
    assert torch.equal(last_logits(by_head), got)
