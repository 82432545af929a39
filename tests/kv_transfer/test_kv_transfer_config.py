"""``--kv-transfer-config`` / ``LLM(kv_transfer_config=...)`` in the reference engine's JSON form,
mapped onto the engine's P/D role."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from warmcap.cli import app
from warmcap.config import EngineConfig, KVTransferConfig
from warmcap.errors import ConfigError
from warmcap.llm import build_config

runner = CliRunner()


@pytest.mark.parametrize(
    ("role", "engine_role"),
    [("kv_producer", "producer"), ("kv_consumer", "consumer"), ("kv_both", "consumer")],
)
def test_transfer_role_sets_the_engine_role(role: str, engine_role: str) -> None:
    text = json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "engine_id": "p0"})
    config = build_config("tiny-llama", speculative_config="eagle:3", kv_transfer_config=text)
    assert config.kv_role == engine_role
    assert config.kv_transfer == KVTransferConfig("NixlConnector", role, engine_id="p0")
    # A producer runs no drafter and reserves no lookahead; a decoding instance keeps both.
    assert config.num_lookahead_tokens == (0 if engine_role == "producer" else 3)


def test_a_dict_and_none_are_accepted() -> None:
    config = build_config(
        "tiny-llama", kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    )
    assert config.kv_role == "producer"
    assert build_config("tiny-llama", kv_transfer_config=None).kv_transfer is None
    assert KVTransferConfig.parse("none") is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"kv_role": "kv_consumer"}', 'needs "kv_connector"'),
        ('{"kv_connector": "LMCache", "kv_role": "kv_consumer"}', "kv_connector 'LMCache' is unknown"),
        ('{"kv_connector": "NixlConnector", "kv_role": "consumer"}', "kv_role 'consumer' is unknown"),
        (
            '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_rnk": 0}',
            "unknown kv_transfer_config keys \\['kv_rnk'\\]",
        ),
        ('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_port": 70000}', "kv_port 70000"),
    ],
)
def test_malformed_configs_say_what_is_wrong(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KVTransferConfig.parse(value)


def test_a_contradicting_kv_role_is_refused() -> None:
    transfer = KVTransferConfig("NixlConnector", "kv_producer")
    with pytest.raises(
        ConfigError, match="kv_role 'consumer' contradicts kv_transfer_config kv_role 'kv_producer'"
    ):
        EngineConfig(kv_role="consumer", kv_transfer=transfer)
    assert EngineConfig(kv_role="producer", kv_transfer=transfer).kv_role == "producer"


def _plan(*extra: str) -> dict:
    args = ["plan", "--model", "tiny-llama", "--spec", "dflash:7", "--device", "cpu", "--num-blocks", "64"]
    res = runner.invoke(app, [*args, "--max-model-len", "256", "--json", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_cli_plan_with_a_transfer_config_is_the_role_plan() -> None:
    consumer = '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}'
    assert _plan("--kv-transfer-config", consumer) == _plan("--kv-role", "consumer")
    producer = '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'
    assert _plan("--kv-transfer-config", producer) == _plan("--kv-role", "producer")
    assert _plan("--kv-role", "producer") != _plan("--kv-role", "consumer")


def test_cli_bad_transfer_config_is_a_clear_error_without_traceback() -> None:
    res = runner.invoke(app, ["plan", "--model", "tiny-llama", "--kv-transfer-config", "{oops"])
    assert res.exit_code != 0
    assert "kv_transfer_config is not valid JSON" in res.output and "Traceback" not in res.output
