"""A decode step reads the device once: every host read of a tensor goes through the runner's one
fetch (``runner_v2/host_copy.py``: tokens, accepted counts and the non-finite flag in one copy).

On CUDA each ``.tolist()`` / ``.item()`` / ``bool()`` of a device tensor stalls the host until the
GPU's queue drains; a verify step used to make four. On CPU every tensor is a host tensor, so the
test marks what the fetch returns and counts reads of anything else during whole engine steps."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.engine import LLMEngine
from warmcap.runner_v2.host_copy import HostCopy, PendingCopy
from warmcap.sampling_params import SamplingParams

READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4][: 6 + i] for i in range(3)]


def _engine(spec: str | None, async_scheduling: bool = False) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu", enforce_eager=True),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, async_scheduling=async_scheduling
        ),
        speculative=SpeculativeConfig.parse(spec),
    )
    return LLMEngine(config, startup_hooks=[])


@pytest.mark.parametrize(
    ("spec", "params"),
    [
        (None, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
        ("ngram:2", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
        ("ngram:2", SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)),
    ],
    ids=["decode", "greedy-verify", "random-verify"],
)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_decode_step_reads_the_device_only_through_its_one_fetch(
    monkeypatch, spec, params, async_scheduling
) -> None:
    # CUDA has no screened greedy head (a CPU kernel): take the path a GPU step takes.
    monkeypatch.setenv("WARMCAP_EXACT_GREEDY_HEAD", "0")
    engine = _engine(spec, async_scheduling)
    # The synchronous engine's tokens: async scheduling changes when they are read, never which.
    expected = [o.token_ids for o in _engine(spec).generate(PROMPTS, [params] * len(PROMPTS))]
    ids = [engine.add_request(prompt, params) for prompt in PROMPTS]

    fetched: set[int] = set()
    fetches = Counter()
    stray: Counter[str] = Counter()
    counting = [False]
    real_fetch = HostCopy.fetch
    real_wait = PendingCopy.wait

    def fetch(self, parts):
        out = real_fetch(self, parts)
        fetches["reads"] += 1
        fetched.update(id(t) for t in out)
        return out

    def wait(self):
        # A step in flight is read once: by the next step, or when the engine takes its output.
        fetches["reads"] += self._result is None
        out = real_wait(self)
        fetched.update(id(t) for t in out)
        return out

    real_schedule = engine.scheduler.schedule

    def schedule():
        out = real_schedule()
        fetches["launched"] += not out.is_empty
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)

    def counted(name):
        method = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if counting[0] and id(self) not in fetched:
                stray[name] += 1
            return method(self, *args, **kwargs)

        return read

    monkeypatch.setattr(HostCopy, "fetch", fetch)
    monkeypatch.setattr(PendingCopy, "wait", wait)
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    engine.step()  # the prompts' prefill
    outputs: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        counting[0] = True
        before = fetches["reads"]
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        counting[0] = False
        assert fetches["reads"] - before <= 1, "an engine step read the device more than once"
        steps += 1
    assert steps >= 3
    assert stray == Counter(), f"host reads outside the step's fetch: {dict(stray)}"
    # Every step that ran a forward was read exactly once, in its own engine step or the next.
    assert fetches["reads"] == fetches["launched"]
    # Same tokens as an engine whose reads were never watched.
    assert [outputs[r] for r in ids] == expected
