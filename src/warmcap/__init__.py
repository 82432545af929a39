"""warmcap: trustworthy LLM start-up — warmup planned through the scheduler's reservation rule,
audited KV writes, verified CUDA graphs and exact speculative decoding.

``from warmcap import LLM, SamplingParams`` works as with vLLM; both load lazily, so importing a
submodule (the planner, the audit) never pulls in torch models or the engine.
"""

from __future__ import annotations

from typing import Any

from warmcap.kernels.cpu.threads import prefer_yielding_wait

# NOTE: before anything imports torch, whose OpenMP runtime reads its wait policy once, at load:
# a short spin, then sleep, so that a thread waiting at a barrier on a busy host gives its core
# to the thread it waits for (kernels/cpu/threads.py). A policy the user set is kept.
prefer_yielding_wait()

__version__ = "0.1.0"

__all__ = ["LLM", "RequestOutputKind", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from warmcap.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutputKind"):
        from warmcap import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(f"module 'warmcap' has no attribute {name!r}")
