"""Loader errors a user can hit, each naming the path / file / weight and what to do."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from warmcap.errors import ModelLoadError
from warmcap.models.loader import load_hf_config, load_model, load_tokenizer
from warmcap.models.registry import model_class
from warmcap.models.tiny import write_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("m") / "tiny-llama"
    write_tiny_model("tiny-llama", path)
    return path


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_directory_names_the_path(tmp_path):
    with pytest.raises(ModelLoadError, match=r"does not exist.*preset"):
        load_model(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_hf_config(tmp_path)


def test_config_without_architectures(tmp_path, tiny_llama):
    path = copy_model(tiny_llama, tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    del raw["architectures"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="architectures"):
        load_model(path)


def test_unsupported_architecture_lists_supported(tmp_path, tiny_llama):
    path = copy_model(tiny_llama, tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(path)
    with pytest.raises(ModelLoadError, match="Qwen3ForCausalLM"):
        model_class("Nope")


def test_missing_weight_names_file_and_weight(tmp_path, tiny_llama):
    path = copy_model(tiny_llama, tmp_path / "m")
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path)


def test_wrong_shape_names_file_and_weight(tmp_path, tiny_llama):
    path = copy_model(tiny_llama, tmp_path / "m")
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*k_proj\.weight.*\(3, 64\)"):
        load_model(path)


def test_sharded_checkpoint_with_ignorable_extras_loads_like_single_file(tmp_path, tiny_llama, harness_cls):
    path = copy_model(tiny_llama, tmp_path / "m")
    weights = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        part = {k: weights[k] for k in keys}
        if shard.startswith("model-00002"):
            part["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        save_file(part, str(path / shard))
        weight_map.update(dict.fromkeys(keys, shard))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded, single = load_model(path), load_model(tiny_llama)
    for (n1, p1), (_, p2) in zip(sharded.named_parameters(), single.named_parameters(), strict=True):
        assert torch.equal(p1, p2), n1


def test_unexpected_weight_is_an_error(tmp_path, tiny_llama):
    path = copy_model(tiny_llama, tmp_path / "m")
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"unexpected weight.*q_norm"):
        load_model(path)


def test_unknown_rope_type_names_it(tmp_path, tiny_llama):
    path = copy_model(tiny_llama, tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw["rope_parameters"] = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 512,
    }
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"longrope.*yarn"):
        load_model(path)


def test_tokenizer_round_trips_and_has_chat_template(tiny_llama):
    tok = load_tokenizer(tiny_llama)
    ids = tok("The capital of France is Paris.").input_ids
    assert tok.decode(ids) == "The capital of France is Paris."
    assert tok.eos_token is not None
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "hi" in text and text.endswith("assistant\n")


def test_importing_model_modules_does_not_import_transformers():
    """transformers costs seconds to import; CLI paths that only plan must not pay for it."""
    code = (
        "import sys, warmcap.models.loader, warmcap.models.presets, warmcap.models.llama, "
        "warmcap.models.registry, warmcap.runner_v2.attention.selector; "
        "sys.exit('transformers' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_loading_a_model_does_not_import_torch_dynamo(tiny_llama):
    """Building the model on the meta device used to pull in torch._dynamo (about 0.8 s of every
    start) through nn.Embedding's init; the loaded weights are still the checkpoint's."""
    code = (
        "import sys, torch; from safetensors.torch import load_file; "
        "from warmcap.models.loader import load_model; "
        f"m = load_model({str(tiny_llama)!r}); "
        f"ref = load_file({str(tiny_llama / 'model.safetensors')!r}); "
        "emb = [p for n, p in m.named_parameters() if n.endswith('embed_tokens.weight')][0]; "
        "assert torch.equal(emb, ref['model.embed_tokens.weight']), 'embedding not loaded'; "
        "sys.exit('torch._dynamo' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize(
    ("content", "says"),
    [("[1, 2, 3]", "JSON list"), ("{not json", "not valid JSON"), ("\udcff", "not valid JSON")],
)
def test_config_that_is_not_a_json_object_names_the_file(tmp_path, tiny_llama, content, says):
    model = copy_model(tiny_llama, tmp_path / "m")
    (model / "config.json").write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.raises(ModelLoadError, match=says) as info:
        load_hf_config(model)
    assert "config.json" in str(info.value)


@pytest.mark.parametrize("content", ["{broken", '["model.safetensors"]', '{"weight_map": [1]}'])
def test_malformed_shard_index_names_the_file(tmp_path, tiny_llama, content):
    model = copy_model(tiny_llama, tmp_path / "m")
    (model / "model.safetensors.index.json").write_text(content)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors\.index\.json"):
        load_model(model)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_safetensors_names_the_file(tmp_path, tiny_llama, damage):
    model = copy_model(tiny_llama, tmp_path / "m")
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07garbage" * 64)
    with pytest.raises(ModelLoadError, match="not a readable safetensors file") as info:
        load_model(model)
    assert str(weights) in str(info.value)


def test_damaged_preset_entry_says_which_folder_to_delete_and_rebuilds(tmp_path, monkeypatch):
    from warmcap.models import presets

    monkeypatch.setenv("WARMCAP_CACHE", str(tmp_path / "cache"))
    entry = presets.resolve_model("tiny-llama")
    (entry / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ModelLoadError) as info:
        load_model(presets.resolve_model("tiny-llama"))
    message = str(info.value)
    assert f"delete the folder {str(entry)!r}" in message and "WARMCAP_REBUILD=1" in message

    monkeypatch.setenv("WARMCAP_REBUILD", "1")
    rebuilt = presets.resolve_model("tiny-llama")
    assert rebuilt == entry and load_model(rebuilt) is not None
    # rebuilt once per process, not on every resolve
    mtime = (entry / "model.safetensors").stat().st_mtime_ns
    assert presets.resolve_model("tiny-llama") == entry
    assert (entry / "model.safetensors").stat().st_mtime_ns == mtime
