from __future__ import annotations

import pytest

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "method", "k", "model"),
    [
        ("eagle3:3", "eagle3", 3, None),
        ("dflash:7", "dflash", 7, None),
        ("draft_model:3@./draft", "draft_model", 3, "./draft"),
        ("ngram", "ngram", 1, None),
        ("  mtp:2 ", "mtp", 2, None),
    ],
)
def test_short_form(text, method, k, model):
    spec = SpeculativeConfig.parse(text)
    assert (spec.method, spec.num_speculative_tokens, spec.model) == (method, k, model)
    assert SpeculativeConfig.parse(spec.short()) == spec


def test_json_and_mapping_forms():
    text = '{"method": "eagle", "num_speculative_tokens": 4, "model": "/m"}'
    spec = SpeculativeConfig.parse(text)
    assert (spec.method, spec.num_speculative_tokens, spec.model) == ("eagle", 4, "/m")
    ngram = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (ngram.num_speculative_tokens, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (2, 1, 3)


@pytest.mark.parametrize("text", [None, "", "none", "off"])
def test_no_speculation(text):
    assert SpeculativeConfig.parse(text) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("medusa:3", "unknown speculative method 'medusa'"),
        ("eagle:0", "got 0"),
        ("eagle:-2", "got -2"),
        ("eagle:17", "got 17"),
        ("eagle:x", "'eagle:x': K must be an integer"),
        ('{"method": "eagle",', "not valid JSON"),
        ("[1]", "unknown speculative method '\\[1\\]'"),
        ('{"method": "eagle", "k": 3}', "unknown speculative config keys \\['k'\\]"),
        ('{"num_speculative_tokens": 3}', 'needs "method"'),
        ('{"method": "ngram", "num_speculative_tokens": "3"}', "num_speculative_tokens: .*got '3'"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens: .*got True"),
        ("ngram:2@./draft", "drop the @DRAFT path"),
        ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "got 5..2"),
    ],
)
def test_bad_speculative_configs_name_the_value(text, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse(text)


@pytest.mark.parametrize("block_size", [0, 3, 12, 24, -16])
def test_block_size_must_be_a_power_of_two(block_size):
    with pytest.raises(ConfigError, match=f"power of two.*got {block_size}"):
        CacheConfig(block_size=block_size)


@pytest.mark.parametrize("block_size", [1, 2, 16, 128])
def test_power_of_two_block_sizes_are_accepted(block_size):
    assert CacheConfig(block_size=block_size).block_size == block_size


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SchedulerConfig(max_model_len=0), "max_model_len must be >= 1; got 0"),
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs must be >= 1; got 0"),
        (lambda: SchedulerConfig(max_num_batched_tokens=-1), "got -1"),
        (
            lambda: SchedulerConfig(max_prefill_tokens_with_decodes=-1),
            "max_prefill_tokens_with_decodes must be a token count >= 1, or 0 for no cap; got -1",
        ),
        (
            lambda: SchedulerConfig(max_prefill_tokens_with_decodes=256, enable_chunked_prefill=False),
            "max_prefill_tokens_with_decodes=256 needs chunked prefill.*enable chunked prefill",
        ),
        (lambda: CacheConfig(num_blocks=1), "at least 2.*got 1"),
        (lambda: CacheConfig(memory_fraction=1.5), "got 1.5"),
        (lambda: CacheConfig(mamba_cache_mode="some"), "'some' is unknown"),
        (lambda: ModelConfig(dtype="int4"), "'int4' is not supported"),
        (lambda: ModelConfig(device="tpu"), "'tpu' is not supported"),
        (lambda: EngineConfig(kv_role="both"), "'both' is unknown"),
    ],
)
def test_bad_settings_raise_config_errors_naming_the_value(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_max_model_len_must_be_resolved_and_fit_the_model():
    config = EngineConfig()
    with pytest.raises(ConfigError, match="unresolved"):
        _ = config.max_model_len
    resolved = config.with_max_model_len(512)
    assert resolved.max_model_len == 512
    resolved.validate_against(model_max_len=512)
    with pytest.raises(ConfigError, match="512 exceeds the model's limit 256"):
        resolved.validate_against(model_max_len=256)


@pytest.mark.parametrize("text", ["eagle3:", "dflash: @./head", "mtp:@./head"])
def test_a_colon_without_k_is_refused_not_read_as_k_1(text):
    method = text.partition(":")[0]
    with pytest.raises(ConfigError, match=f"{text!r} has ':' but no K.*as in {method}:3"):
        SpeculativeConfig.parse(text)


def test_an_unknown_method_error_lists_every_method():
    with pytest.raises(ConfigError) as err:
        SpeculativeConfig.parse('{"method": "medusa", "num_speculative_tokens": 2}')
    listed = str(err.value).partition("use one of ")[2]
    assert listed.split(", ") == ["ngram", "draft_model", "eagle", "eagle3", "mtp", "dflash"]
