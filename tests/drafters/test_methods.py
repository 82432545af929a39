"""The table of speculative methods: what the engine reserves and batches for each method and k
agrees with the reference engine's facts, every table method has exactly one drafter class, and the
drafter built for a method writes as far ahead as the table says."""

from __future__ import annotations

from functools import cache

import pytest

from warmcap.config import EngineConfig, ModelConfig, SpeculativeConfig
from warmcap.drafters import build_drafter
from warmcap.drafters.base import BaseDrafter
from warmcap.drafters.ngram import NgramDrafter
from warmcap.drafters.registry import drafter_class, register, registered_methods
from warmcap.errors import ConfigError
from warmcap.spec_methods import METHODS

# vLLM's facts, written independently of the table: the KV slots each method's drafter writes
# past the scheduled tokens, for k draft tokens.
REFERENCE_LOOKAHEAD = {
    "ngram": lambda k: 0,
    "draft_model": lambda k: k,
    "eagle": lambda k: k,
    "eagle3": lambda k: k,
    "mtp": lambda k: k,
    "dflash": lambda k: k + 1,
}


@cache
def _target():
    from warmcap.models.loader import load_model
    from warmcap.models.presets import resolve_model

    return load_model(resolve_model("tiny-llama"))


def _config(method: str, k: int, kv_role: str = "none") -> EngineConfig:
    draft = "@self" if method == "draft_model" else ""
    spec = SpeculativeConfig.parse(f"{method}:{k}{draft}")
    return EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu"), speculative=spec, kv_role=kv_role
    )


def test_the_table_covers_the_reference_methods_and_each_has_one_drafter_class() -> None:
    assert set(METHODS) == set(REFERENCE_LOOKAHEAD)
    assert registered_methods() == tuple(METHODS)
    for method in METHODS:
        assert drafter_class(method).method == method


@pytest.mark.parametrize("method", list(REFERENCE_LOOKAHEAD))
@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_lookahead_and_uniform_query_len_follow_the_reference(method: str, k: int) -> None:
    config = _config(method, k)
    assert config.num_lookahead_tokens == REFERENCE_LOOKAHEAD[method](k)
    assert config.uniform_decode_query_len == 1 + k
    # A P/D prefill producer drafts nothing: no lookahead, plain one-token decodes.
    producer = _config(method, k, kv_role="producer")
    assert (producer.num_lookahead_tokens, producer.uniform_decode_query_len) == (0, 1)


@pytest.mark.parametrize("method", list(REFERENCE_LOOKAHEAD))
@pytest.mark.parametrize("k", [1, 4])
def test_the_built_drafter_writes_as_far_ahead_as_the_table_says(method: str, k: int) -> None:
    config = _config(method, k)
    drafter = build_drafter(config, _target())
    assert isinstance(drafter, drafter_class(method))
    assert drafter.lookahead == METHODS[method].lookahead(k) == REFERENCE_LOOKAHEAD[method](k)
    assert drafter.num_speculative_tokens == k
    entry = METHODS[method]
    # What the table says a method drafts with is what the factory gave it.
    assert hasattr(drafter, "head") == entry.needs_head
    assert hasattr(drafter, "model") == entry.needs_draft_model
    if entry.default_aux_layers is None:
        assert drafter.aux_layers == ()
    else:
        assert drafter.aux_layers == entry.default_aux_layers(_target().hf_config.num_hidden_layers)


def test_methods_read_hidden_states_exactly_when_they_draft_with_a_head() -> None:
    assert {m for m, e in METHODS.items() if e.reads_hidden_states} == {"eagle", "eagle3", "mtp", "dflash"}
    assert all(e.reads_hidden_states == e.needs_head for e in METHODS.values())


def test_a_drafter_class_for_an_unknown_or_taken_method_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown speculative method 'medusa'"):

        @register
        class Medusa(NgramDrafter):
            method = "medusa"

    with pytest.raises(TypeError, match="both register speculative method 'ngram'"):

        @register
        class Another(NgramDrafter):
            pass

    assert drafter_class("ngram") is NgramDrafter
    assert issubclass(drafter_class("ngram"), BaseDrafter)
