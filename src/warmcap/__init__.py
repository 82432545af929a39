"""warmcap: trustworthy LLM start-up — warmup planned through the scheduler's reservation rule,
audited KV writes, verified CUDA graphs and exact speculative decoding."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
