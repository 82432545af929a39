"""The engine survives its users: a refused prompt, Ctrl-C inside a step, a failing forward or
non-finite logits abort the failed batch, free its blocks, and leave the engine usable."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from warmcap.cli import app
from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from warmcap.engine import LLMEngine
from warmcap.errors import ConfigError, NonFiniteLogitsError
from warmcap.llm import LLM
from warmcap.models.presets import resolve_model
from warmcap.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]]
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-llama", device="cpu", max_model_len=MAX_MODEL_LEN, num_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def expected(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _assert_clean(engine: LLMEngine) -> None:
    """No request left anywhere and every block back in the pool (the null block excluded)."""
    assert not engine.has_unfinished()
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.num_blocks - 1
    engine.step()  # hands the aborted ids to the runner
    assert engine.runner.batch.num_reqs == 0


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ([1] * (MAX_MODEL_LEN + 3), "max_model_len"),
        ([], "empty prompt"),
        ("", "empty prompt"),
        ([3, 512], "512"),
        ([3, -1], "-1"),
        ([3, 2.0], "2.0"),
        ([3, True], "True"),
        ({"prompt_token_ids": [3, 600]}, "600"),
        ({"text": "hi"}, "prompt"),
    ],
)
def test_a_refused_prompt_queues_nothing_and_the_next_generate_works(
    llm: LLM, expected: list[list[int]], bad: object, needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        llm.generate([PROMPTS[0], bad, PROMPTS[1]], GREEDY)
    _assert_clean(llm.engine)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def test_generate_returns_only_its_own_requests(llm: LLM, expected: list[list[int]]) -> None:
    # Another caller's request that finishes first must not be counted as one of ours.
    llm.engine.add_request([3, 4], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    _assert_clean(llm.engine)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_error_inside_a_step_aborts_the_batch(
    llm: LLM, expected: list[list[int]], monkeypatch: pytest.MonkeyPatch, error: type[BaseException]
) -> None:
    """Ctrl-C (or a failing forward) after the runner took the batch: nothing is left behind."""
    engine = llm.engine
    real = engine.model.compute_logits
    calls = []

    def fail_on_third(hidden: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise error("boom")
        return real(hidden)

    monkeypatch.setattr(engine.model, "compute_logits", fail_on_third)
    # every step computes its logits in full, through the failing function (models/greedy_head.py)
    monkeypatch.setattr(engine.runner, "greedy_head", None)
    with pytest.raises(error):
        llm.generate(PROMPTS, GREEDY)
    monkeypatch.setattr(engine.model, "compute_logits", real)
    _assert_clean(engine)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def test_a_failed_step_aborts_its_batch_and_later_requests_run(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.engine
    first = engine.add_request(PROMPTS[0], GREEDY)

    def boom(sched_out):
        raise RuntimeError("input preparation failed")

    # The runner has taken the step's deltas (new rows) when preparing its inputs fails.
    monkeypatch.setattr(engine.runner.batch, "prepare_inputs", boom)
    with pytest.raises(RuntimeError):
        engine.step()
    monkeypatch.undo()
    later = engine.add_request(PROMPTS[1], GREEDY)
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished) == [later]  # the failed step's request was aborted, the new one runs
    assert not engine.abort(first)
    _assert_clean(engine)


def test_an_abandoned_stream_aborts_its_request(llm: LLM) -> None:
    stream = llm.generate_stream(
        "hello there", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )
    next(stream)
    stream.close()
    _assert_clean(llm.engine)


def _nan_model(tmp_path: Path) -> Path:
    src = resolve_model("tiny-llama")
    dst = tmp_path / "nan-llama"
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights = {k: torch.full_like(v, float("nan")) if "norm" in k else v for k, v in weights.items()}
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_nan_weights_raise_an_error_naming_the_model(tmp_path: Path) -> None:
    path = _nan_model(tmp_path)
    config = EngineConfig(
        model=ModelConfig(model=str(path), device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=32),
        scheduler=SchedulerConfig(max_model_len=64),
    )
    engine = LLMEngine(config, startup_hooks=[])
    with pytest.raises(NonFiniteLogitsError, match="nan-llama"):
        engine.generate(PROMPTS, [GREEDY, GREEDY])
    _assert_clean(engine)


def test_an_unusable_model_exits_2_with_one_line_whatever_makes_it_so(tmp_path: Path) -> None:
    """One rule for a model given that cannot be used: NaN logits, a folder that is no model,
    a checkpoint that does not load all exit 2 (usage), with one line naming it."""
    nan = _nan_model(tmp_path)
    broken = tmp_path / "broken-llama"
    shutil.copytree(resolve_model("tiny-llama"), broken)
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    for path, needle in (
        (nan, "non-finite"),
        (tmp_path / "missing", "neither a preset"),
        (broken, "broken-llama"),
    ):
        res = CliRunner().invoke(
            app, ["generate", "-m", str(path), "-p", "hi", "--max-tokens", "4", "--max-model-len", "64"]
        )
        assert res.exit_code == 2, res.output
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1 and needle in lines[0] and path.name in lines[0], res.output
