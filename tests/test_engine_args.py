"""One table of engine options (``engine_args.ENGINE_ARGS``) serves ``LLM``, the ``warmup`` commands
and the server: a setting in the table reaches the config from every surface, and ``warmup plan``
and ``warmup run`` given the same flags describe the same engine."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from warmcap import engine_args, llm
from warmcap.cli import app
from warmcap.config import EngineConfig, KVTransferConfig, SpeculativeConfig
from warmcap.engine_args import ENGINE_ARGS, build_config
from warmcap.errors import ConfigError

MODEL = "tiny-llama"
#: a value other than the default for every option of the table; an option added to the table
#: without one here fails test_every_option_has_an_example
EXAMPLES: dict[str, Any] = {
    "dtype": "bfloat16",
    "device": "cpu",
    "seed": 7,
    "enforce_eager": True,
    "batch_invariant": True,
    "attention_backend": "torch",
    "block_size": 32,
    "num_blocks": 77,
    "gpu_memory_utilization": 0.5,
    "kv_cache_space": 0.5,
    "enable_prefix_caching": False,
    "mamba_cache_mode": "all",
    "max_num_seqs": 3,
    "max_num_batched_tokens": 96,
    "max_prefill_tokens_with_decodes": 64,
    "max_model_len": 192,
    "enable_chunked_prefill": False,
    "async_scheduling": True,
    "speculative_config": "ngram:3",
    "kv_role": "consumer",
    "kv_transfer_config": '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}',
    "tensor_parallel_size": 2,
    "cpu_threads": 1,
    "cpu_threads_bind": "none",
    "cpu_gemm": "torch",
    "cpu_layer_ops": "torch",
    "cpu_attention": "kernel",
    "cpu_isa": "avx2",
    "exact_greedy_head": "portable",
    "fused_ops": "torch",
    "tp_comm": "gloo",
    "tp_balance": "heads",
}
ENGINE_COMMANDS = ("plan", "run", "serve", "generate")


def _landed(config: EngineConfig, name: str) -> Any:
    arg = engine_args.ARGS_BY_NAME[name]
    return getattr(config, arg.attr) if arg.part is None else getattr(getattr(config, arg.part), arg.attr)


def _expected(name: str, value: Any) -> Any:
    if name == "speculative_config":
        return SpeculativeConfig.parse(value)
    if name == "kv_transfer_config":
        return KVTransferConfig.parse(value)
    return value


def _flags(name: str, value: Any) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, str(value)]


class _Built(Exception):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config


@pytest.fixture
def capture_config(monkeypatch: pytest.MonkeyPatch):
    """Stop every surface right after it built its engine config, and hand that config back."""
    real = engine_args.build_config

    def stop(model: str, **kwargs: Any) -> EngineConfig:
        raise _Built(real(model, **kwargs))

    monkeypatch.setattr(engine_args, "build_config", stop)
    monkeypatch.setattr(llm, "build_config", stop)

    def invoke(*argv: str) -> EngineConfig:
        command = argv[0]
        extra = ["--prompt", "hi", "--max-model-len", "64"] if command == "generate" else []
        res = CliRunner().invoke(app, [*argv, "--model", MODEL, *extra])
        assert isinstance(res.exception, _Built), res.output
        return res.exception.config

    return invoke


def test_every_option_has_an_example() -> None:
    assert set(EXAMPLES) == {a.name for a in ENGINE_ARGS}


@pytest.mark.parametrize("name", [a.name for a in ENGINE_ARGS])
def test_each_option_reaches_the_config_from_llm(name: str) -> None:
    config = build_config(MODEL, **{name: EXAMPLES[name]})
    assert _landed(config, name) == _expected(name, EXAMPLES[name])
    assert _landed(config, name) != _landed(build_config(MODEL), name)


@pytest.mark.parametrize(
    ("command", "name"),
    [
        (command, a.name)
        for command in ENGINE_COMMANDS
        for a in ENGINE_ARGS
        # generate's own --max-model-len is set by the fixture; its test is the next one
        if a.cli and (command, a.name) != ("generate", "max_model_len")
    ],
)
def test_each_option_reaches_the_config_from_every_command(capture_config, command: str, name: str) -> None:
    config = capture_config(command, *_flags(name, EXAMPLES[name]))
    assert _landed(config, name) == _expected(name, EXAMPLES[name])


def test_generate_takes_max_model_len_from_the_flag(capture_config) -> None:
    assert capture_config("generate").scheduler.max_model_len == 64


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--spec", "ngram:2", "--max-num-seqs", "2"],
        ["--max-model-len", "512", "--block-size", "32", "--max-num-batched-tokens", "128"],
        ["--spec", "eagle3:3", "--dtype", "bfloat16", "--enforce-eager", "--no-enable-prefix-caching"],
    ],
)
def test_plan_and_run_with_the_same_flags_describe_the_same_engine(capture_config, flags: list[str]) -> None:
    assert capture_config("plan", *flags) == capture_config("run", *flags)


def test_plan_by_default_plans_what_run_runs_by_default(capture_config) -> None:
    planned = capture_config("plan")
    assert planned == capture_config("run")
    # the default start-up has a drafter that writes KV, so the audit sees draft passes
    assert planned.num_lookahead_tokens > 0


def test_a_refusal_names_the_option_as_the_caller_spelled_it() -> None:
    with pytest.raises(ConfigError, match=r"^gpu_memory_utilization must be in \(0, 1\]; got 1.5"):
        build_config(MODEL, gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match=r"^memory_fraction must be in"):
        build_config(MODEL, memory_fraction=1.5)
    res = CliRunner().invoke(app, ["plan", "--model", MODEL, "--gpu-memory-utilization", "1.5"])
    assert res.exit_code == 2
    assert "gpu_memory_utilization must be in (0, 1]" in res.output


def test_unknown_llm_argument_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown engine argument.*max_num_seq'.*valid: .*max_num_seqs"):
        build_config(MODEL, max_num_seq=4)


def test_max_model_len_auto_is_the_models_own_limit(capture_config) -> None:
    assert capture_config("plan", "--max-model-len", "auto").scheduler.max_model_len is None
    res = CliRunner().invoke(app, ["plan", "--model", MODEL, "--max-model-len", "lots"])
    assert res.exit_code == 2
    assert "auto for the model's own limit" in res.output


def test_serve_by_default_takes_vllms_server_limits_for_the_device_and_graphs_on_cpu(
    capture_config,
) -> None:
    config = capture_config("serve", "--device", "cpu")
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (128, 2048)
    # graphs, the ones that record on CPU (serving_graphs, tested below)
    assert not config.model.enforce_eager and config.speculative is None
    assert config.scheduler.max_model_len is None  # the model's own context
    assert config.cache.kv_cache_space_gib is None  # the CPU default space (kv_sizing.py)
    given = capture_config("serve", "--device", "cpu", "--max-num-batched-tokens", "64", "--capture-graphs")
    # never more sequences than tokens a step (as vLLM), and graphs when asked
    assert given.scheduler.max_num_seqs == 64 and not given.model.enforce_eager


def test_serve_on_cpu_caps_prompt_tokens_beside_decodes_unless_told(capture_config) -> None:
    cap = engine_args.SERVING_PREFILL_WITH_DECODES_CPU
    assert capture_config("serve", "--device", "cpu").scheduler.max_prefill_tokens_with_decodes == cap
    # per rank, like the step budget
    tp2 = capture_config("serve", "--device", "cpu", "--tensor-parallel-size", "2")
    assert tp2.scheduler.max_prefill_tokens_with_decodes == 2 * cap
    assert tp2.scheduler.max_num_batched_tokens == 2 * 2048
    # 0 turns it off; a value given is kept; without chunked prefill there is none to refuse
    off = capture_config("serve", "--device", "cpu", "--max-prefill-tokens-with-decodes", "0")
    assert off.scheduler.max_prefill_tokens_with_decodes is None
    given = capture_config("serve", "--device", "cpu", "--max-prefill-tokens-with-decodes", "128")
    assert given.scheduler.max_prefill_tokens_with_decodes == 128
    whole = capture_config("serve", "--device", "cpu", "--no-enable-chunked-prefill")
    assert whole.scheduler.max_prefill_tokens_with_decodes is None
    # LLM keeps the config's own default: no cap
    assert build_config(MODEL, device="cpu").scheduler.max_prefill_tokens_with_decodes is None


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--spec", "ngram:2", "--max-num-seqs", "16"],
        ["--max-model-len", "256", "--enforce-eager", "--kv-cache-space", "1"],
    ],
)
def test_plan_serve_describes_the_engine_serve_builds(capture_config, flags: list[str]) -> None:
    assert capture_config("plan", "--serve", "--device", "cpu", *flags) == capture_config(
        "serve", "--device", "cpu", *flags
    )


def test_serve_on_cpu_captures_the_graphs_that_record_and_leaves_given_choices_alone() -> None:
    from warmcap.cli import serving_graphs
    from warmcap.config import StartupOptions

    base = {"device": "cpu", "max_num_seqs": 128, "enforce_eager": None, "speculative_config": "none"}
    engine, startup = serving_graphs(base, StartupOptions())
    assert engine["enforce_eager"] is False
    # the ladder up to the 32-token recording limit, decode graphs only
    assert startup.capture_sizes == (1, 2, 4, 8, 16, 24, 32) and startup.graph_shapes == "decode"
    # a speculative decode step is 1 + k tokens a row: the ladder is capped the same way
    _, spec = serving_graphs({**base, "max_num_seqs": 2, "speculative_config": "ngram:3"}, StartupOptions())
    assert spec.capture_sizes == (1, 2, 4, 8, 16)
    # what the user gave stays: eager, sizes, shapes
    eager, untouched = serving_graphs({**base, "enforce_eager": True}, StartupOptions())
    assert eager["enforce_eager"] is True and untouched == StartupOptions()
    _, given = serving_graphs(base, StartupOptions(capture_sizes=(1, 64), graph_shapes="all"))
    assert given.capture_sizes == (1, 64) and given.graph_shapes == "all"
