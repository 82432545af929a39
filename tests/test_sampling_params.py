"""SamplingParams refuses what vLLM refuses, with a ConfigError naming the field and the value."""

from __future__ import annotations

import math

import numpy as np
import pytest

from warmcap.errors import ConfigError
from warmcap.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seed": "abc"}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"min_p": math.inf}, "min_p"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": False}, "top_k"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"n": 0}, "n"),
        ({"n": 1.0}, "n"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kwargs)


def test_vllm_spellings_are_accepted() -> None:
    assert SamplingParams(top_k=-1).top_k == -1  # vLLM's "disabled"
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(temperature=0).greedy  # an int temperature is a number
    assert SamplingParams(temperature=np.float32(0.5), max_tokens=np.int64(4)).max_tokens == 4
    p = SamplingParams(n=3, logprobs=5, min_tokens=4, max_tokens=8, stop_token_ids=[7, 8])
    assert (p.n, p.logprobs, p.min_tokens, p.stop_token_ids) == (3, 5, 4, (7, 8))


def test_min_tokens_holds_back_eos_unless_ignored() -> None:
    p = SamplingParams(stop_token_ids=[5], min_tokens=2)
    assert p.all_stop_token_ids == (5,)
    assert p.with_eos(0).all_stop_token_ids == (5, 0)
    assert p.with_eos(5).all_stop_token_ids == (5,)
    assert SamplingParams(min_tokens=2, ignore_eos=True).with_eos(0).all_stop_token_ids == ()
