"""Pick the runner's backends for a device: FlashInfer attention on CUDA when importable, else pure
torch; the torch MLA, lightning-indexer and Mamba2 backends everywhere."""

from __future__ import annotations

import importlib.util

import torch

from warmcap.config import ATTENTION_BACKENDS
from warmcap.contracts.backends import AttentionBackend
from warmcap.contracts.registry import BackendRegistry
from warmcap.errors import ConfigError
from warmcap.runner_v2.attention.indexer import TorchIndexerBackend
from warmcap.runner_v2.attention.mamba2 import TorchMambaBackend
from warmcap.runner_v2.attention.mla import TorchMLABackend
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention

BACKEND_NAMES: tuple[str, ...] = ATTENTION_BACKENDS


def flashinfer_available() -> bool:
    """FlashInfer can run here: CUDA is present and the package is installed."""
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def select_backend(
    device: str | torch.device, *, name: str = "auto", batch_invariant: bool = False
) -> AttentionBackend:
    """The attention backend ``name`` (``auto``: FlashInfer on CUDA when available, torch otherwise);
    ``batch_invariant``: the torch backend keeps gather + SDPA on every step (no CPU kernel)."""
    if name not in BACKEND_NAMES:
        raise ConfigError(f"attention backend {name!r} is unknown; use one of {', '.join(BACKEND_NAMES)}")
    on_cuda = torch.device(device).type == "cuda"
    if name == "flashinfer" or (name == "auto" and on_cuda and flashinfer_available()):
        if not on_cuda or not torch.cuda.is_available():
            raise ConfigError(
                f"the flashinfer attention backend needs a CUDA device; got device {str(device)!r} "
                f"(CUDA available: {torch.cuda.is_available()}); use backend 'torch' on CPU"
            )
        from warmcap.runner_v2.attention.flashinfer import FlashInferAttention

        return FlashInferAttention(torch.device(device))
    return TorchPagedAttention(device, batch_invariant=batch_invariant)


def backend_registry(attention: AttentionBackend) -> BackendRegistry:
    """The backend of every KV kind: ``attention`` for full and sliding-window layers, the torch
    MLA and lightning-indexer backends for latent-attention layers, the torch Mamba2 backend for
    Mamba layers."""
    return BackendRegistry(
        {
            "full": attention,
            "sliding_window": attention,
            "mla": TorchMLABackend(),
            "indexer": TorchIndexerBackend(),
            "mamba": TorchMambaBackend(),
        }
    )
