"""One tiny-llama engine per kernel mode, the same greedy prompts through each: what the tests of the
kernel families loaded at model load compare (the generations of ``torch`` and ``kernel`` mode)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

PROMPTS = [[1, 5, 9, 13, 2], [7, 7, 3], [100, 42, 17, 8, 8, 30, 4]]


def generate_per_mode(
    monkeypatch: pytest.MonkeyPatch, env: str, check_model: Callable[[str, torch.nn.Module], None]
) -> dict[str, list]:
    """``{mode: outputs}`` for ``$env`` = torch and kernel; ``check_model(mode, model)`` sees each
    engine's model before it generates."""
    from warmcap.llm import LLM
    from warmcap.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    results = {}
    for mode in ("torch", "kernel"):
        monkeypatch.setenv(env, mode)
        llm = LLM("tiny-llama", device="cpu", num_blocks=64, max_model_len=128, enforce_eager=True)
        check_model(mode, llm.engine.model)
        results[mode] = llm.generate(PROMPTS, params)
    return results


def assert_same_generation(results: dict[str, list]) -> None:
    """Both modes chose the same tokens, with logprobs within 1e-4."""
    for plain, other in zip(results["torch"], results["kernel"], strict=True):
        assert other.token_ids == plain.token_ids
        for a, b in zip(plain.outputs[0].logprobs, other.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            for token in a:
                assert b[token].logprob == pytest.approx(a[token].logprob, abs=1e-4)
