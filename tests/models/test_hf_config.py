"""The config warmcap hands around (``models/hf_config.py``): for every preset it reads like the config
``AutoConfig`` gives, builds the same model, is cached across starts by content, and lets
``AutoTokenizer`` build the same tokenizer without reading the config again."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoTokenizer

from warmcap.models import hf_config
from warmcap.models.hf_config import HFConfig
from warmcap.models.loader import load_hf_config, load_tokenizer
from warmcap.models.presets import PRESETS, resolve_model
from warmcap.models.registry import model_class

PRESET_NAMES = [name for name in PRESETS if name != "smollm2-135m"]


def real_config(path):
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def public_values(config) -> dict:
    """What a reader of ``config`` sees: every public, non-callable attribute it answers."""
    out = {}
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in dir(config):
                if name.startswith("__"):
                    continue
                try:
                    value = getattr(config, name)
                except Exception:  # unanswerable properties are not values
                    continue
                if not callable(value) or isinstance(value, torch.dtype):
                    out[name] = value
    finally:
        quiet.setLevel(level)
    return out


@pytest.mark.parametrize("name", [*PRESET_NAMES, pytest.param("smollm2-135m", marks=pytest.mark.real_model)])
def test_every_value_reads_as_autoconfig_gives_it_and_builds_the_same_model(name) -> None:
    path = resolve_model(name)
    real = real_config(path)
    ours = load_hf_config(path)
    assert isinstance(ours, HFConfig)
    carried = set(ours.to_dict()) - {hf_config.SKIPPED}
    expected = public_values(real)
    for attr, value in expected.items():
        if attr in carried:
            assert getattr(ours, attr) == value, attr
            assert type(getattr(ours, attr)) is type(value), attr
        else:
            # Not carried: says so instead of answering with a default.
            with pytest.raises(AttributeError, match="not a plain value"):
                getattr(ours, attr)
    # transformers' renames resolve to the same values.
    for alias, target in (getattr(real, "attribute_map", None) or {}).items():
        assert getattr(ours, alias) == getattr(real, target)
    # The same model, parameter for parameter.
    cls = model_class(real.architectures[0])
    with torch.device("meta"):
        from_real, from_ours = cls(real), cls(ours)
    assert [(n, p.shape) for n, p in from_real.named_parameters()] == [
        (n, p.shape) for n, p in from_ours.named_parameters()
    ]
    assert from_real.kv_layer_specs(16) == from_ours.kv_layer_specs(16)


def test_a_second_load_reads_the_cache_without_autoconfig(monkeypatch) -> None:
    path = resolve_model("tiny-llama")
    first = load_hf_config(path)

    def no_autoconfig(*args, **kwargs):
        raise AssertionError("AutoConfig read the config again although it is cached")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_autoconfig)
    assert load_hf_config(path) == first


def test_an_edited_config_is_read_again(tmp_path) -> None:
    src = resolve_model("tiny-llama")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = json.loads((src / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config))
    assert load_hf_config(model_dir).rms_norm_eps == config["rms_norm_eps"]
    (model_dir / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.125}))
    assert load_hf_config(model_dir).rms_norm_eps == 0.125


def test_a_corrupt_cache_entry_is_ignored_with_a_warning_and_rewritten(caplog) -> None:
    path = resolve_model("tiny-qwen2")
    good = load_hf_config(path)
    key = str(path.resolve()).encode() + b"\0" + (path / "config.json").read_bytes()
    cache_file = hf_config._cache_file(key)
    cache_file.write_text('{"version": 1, "values": {"dtype": {"__dtype__": "no_such_dtype"}}}')
    with caplog.at_level(logging.WARNING, logger="warmcap.models"):
        again = load_hf_config(path)
    assert again == good
    assert any("ignored, it will be rebuilt" in r.getMessage() for r in caplog.records)
    assert hf_config.cached_config(key) == good


@pytest.mark.parametrize("name", ["tiny-llama", pytest.param("smollm2-135m", marks=pytest.mark.real_model)])
def test_the_tokenizer_built_with_our_config_is_autotokenizers(name) -> None:
    path = resolve_model(name)
    ours = load_tokenizer(path, config=load_hf_config(path))
    plain = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert type(ours) is type(plain)
    assert ours.get_vocab() == plain.get_vocab()
    assert ours.all_special_ids == plain.all_special_ids
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
        plain.eos_token_id,
        plain.bos_token_id,
        plain.pad_token_id,
    )
    assert ours.chat_template == plain.chat_template
    for text in ["Hello, world!", "  spaced\tout\n\nlines ", "ünïcødé ✓ 🙂", ""]:
        ids = ours.encode(text)
        assert ids == plain.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == plain.decode(ids, skip_special_tokens=True)
    if plain.chat_template:
        messages = [{"role": "user", "content": "What is warmup?"}]
        assert ours.apply_chat_template(messages, add_generation_prompt=True) == plain.apply_chat_template(
            messages, add_generation_prompt=True
        )
