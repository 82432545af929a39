"""The drafter interface: lookahead agrees with the reservation table, drafter KV groups are
separate and marked, graph shapes, the factory, and loading head checkpoints in public layouts."""

from __future__ import annotations

import json
from functools import cache

import pytest
import torch
from safetensors.torch import save_file

from warmcap.config import SPEC_METHODS, EngineConfig, ModelConfig, SpeculativeConfig
from warmcap.drafters import DraftGraphShape, build_drafter
from warmcap.drafters.draft_model import DraftModelDrafter
from warmcap.drafters.heads import Eagle3Head
from warmcap.errors import ConfigError, ModelLoadError


@cache
def _target():
    from warmcap.models.loader import load_model
    from warmcap.models.presets import resolve_model

    return load_model(resolve_model("tiny-llama"))


def _config(spec: str, **kwargs) -> EngineConfig:
    model = ModelConfig(model="tiny-llama", device="cpu")
    return EngineConfig(model=model, speculative=SpeculativeConfig.parse(spec), **kwargs)


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_lookahead_and_groups_follow_the_reservation_table(method: str) -> None:
    config = _config(f"{method}:3@self" if method == "draft_model" else f"{method}:3")
    drafter = build_drafter(config, _target())
    assert drafter is not None and drafter.method == method
    assert drafter.lookahead == config.num_lookahead_tokens == {"ngram": 0, "dflash": 4}.get(method, 3)
    groups = drafter.kv_groups(16)
    if method == "ngram":
        assert groups == [] and drafter.draft_model is None
        return
    assert groups and all(g.is_drafter and g.name.startswith("draft.") for g in groups)
    assert all(layer.startswith("draft.") for g in groups for layer in g.layer_names)
    target_layers = set(_target().kv_layer_specs(16))
    assert not target_layers & {layer for g in groups for layer in g.layer_names}
    # The passes to capture are the draft model's, set by the strategy that runs them.
    assert drafter.draft_model is not None and drafter.draft_model.graph_groups() == groups
    shapes = drafter.draft_model.graph_shapes()
    assert shapes[0] == DraftGraphShape("draft_prefill", None)
    decode = shapes[1]
    if method == "dflash":
        assert (decode.query_len, decode.repeats) == (4, 1)
    else:
        assert (decode.query_len, decode.repeats) == (1, 2)


def test_no_drafter_without_speculation_or_for_ngram_on_a_prefill_producer() -> None:
    assert build_drafter(EngineConfig(model=ModelConfig(model="tiny-llama")), _target()) is None
    assert build_drafter(_config("ngram:3", kv_role="producer"), _target()) is None


@pytest.mark.parametrize("spec", ["eagle:2", "dflash:7", "draft_model:2@self"])
def test_a_prefill_producer_keeps_a_model_drafter_that_writes_no_lookahead(spec: str) -> None:
    # Its prompt pass writes the drafter KV a P/D consumer reads; it proposes nothing, so it writes
    # nothing past the scheduled tokens and has no draft-decode graphs.
    drafter = build_drafter(_config(spec, kv_role="producer"), _target())
    assert drafter is not None and (drafter.num_speculative_tokens, drafter.lookahead) == (0, 0)
    assert drafter.kv_groups(16) and drafter.draft_model.graph_shapes() == [
        DraftGraphShape("draft_prefill", None)
    ]


def test_a_drafter_whose_writes_disagree_with_the_reservation_is_refused(monkeypatch) -> None:
    # A reservation table that reserves less than a draft LM writes past its tokens.
    monkeypatch.setattr(EngineConfig, "num_lookahead_tokens", property(lambda self: 0))
    with pytest.raises(ConfigError, match=r"writes 2 KV slots .* reserves 0"):
        DraftModelDrafter(_config("draft_model:2@self"), _target())
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="draft_model"):
        DraftModelDrafter(_config("eagle:2"), _target())


def test_draft_model_with_another_vocabulary_is_refused(tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match="vocabulary 100"):
        build_drafter(_config(f"draft_model:2@{tmp_path}"), _target())


def _save_head(path, state: dict[str, torch.Tensor], config: dict | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))


def test_eagle3_head_directory_loads_with_its_draft_vocabulary(tmp_path) -> None:
    target = _target()
    source = build_drafter(_config("eagle3:2"), target).head
    draft_vocab = 64
    state = {k: v.clone() for k, v in source.state_dict().items() if k not in ("lm_head.weight", "d2t")}
    state["lm_head.weight"] = torch.randn(draft_vocab, target.hf_config.hidden_size)
    # Draft id i stands for target id 3 * i (d2t holds the offset).
    state["d2t"] = torch.arange(draft_vocab) * 2
    state["t2d"] = torch.zeros(target.hf_config.vocab_size, dtype=torch.bool)
    state["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    _save_head(tmp_path / "head", state, {"aux_hidden_state_layer_ids": [0, 1, 1]})
    drafter = build_drafter(_config(f"eagle3:2@{tmp_path / 'head'}"), target)
    head = drafter.head
    assert isinstance(head, Eagle3Head) and drafter.aux_layers == (0, 1, 1)
    assert torch.equal(head.midlayer.self_attn.q_proj.weight, source.midlayer.self_attn.q_proj.weight)
    hidden = torch.randn(5, target.hf_config.hidden_size)
    picked = head.lm_head(head.norm(hidden)).argmax(dim=-1)
    assert torch.equal(head.draft_tokens(hidden), 3 * picked)


def test_eagle_head_with_fc_bias_and_a_mismatched_checkpoint(tmp_path) -> None:
    target = _target()
    source = build_drafter(_config("eagle:2"), target).head
    state = {f"model.{k}": v.clone() for k, v in source.state_dict().items()}
    state["model.fc.bias"] = torch.full((target.hf_config.hidden_size,), 0.5)
    _save_head(tmp_path / "ok", state)
    head = build_drafter(_config(f"eagle:2@{tmp_path / 'ok'}"), target).head
    assert torch.equal(head.fc.bias, state["model.fc.bias"])

    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(1)
    _save_head(tmp_path / "bad", state)
    with pytest.raises(ModelLoadError, match="unexpected"):
        build_drafter(_config(f"eagle:2@{tmp_path / 'bad'}"), target)


def test_random_heads_are_deterministic() -> None:
    a = build_drafter(_config("mtp:2"), _target()).head.state_dict()
    b = build_drafter(_config("mtp:2"), _target()).head.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
