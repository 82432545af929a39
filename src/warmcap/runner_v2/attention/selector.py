"""Pick the runner's backends for a device. Attention on CUDA: FlashInfer when importable, else the
Triton paged kernel (:mod:`warmcap.kernels.triton.paged_attention`); on CPU (and for batch-invariant
runs) pure torch, which stays the reference everywhere. The torch MLA, lightning-indexer and Mamba2
backends everywhere.

NOTE: the CUDA backends are imported only when chosen: a CPU run never imports FlashInfer, and
imports Triton's kernels only when asked for them by name.
"""

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
    device: str | torch.device,
    *,
    name: str = "auto",
    batch_invariant: bool = False,
    cpu_attention: str | None = None,
) -> AttentionBackend:
    """The attention backend ``name``. ``auto``: on CUDA FlashInfer when available, else Triton; torch
    on CPU, and everywhere with ``batch_invariant`` (FlashInfer and Triton split a row's keys by the
    batch's size, so a row's numbers would depend on its neighbours). ``batch_invariant``: the torch
    backend keeps gather + SDPA on every step (no CPU kernel). ``cpu_attention``: the config's
    ``kernel.cpu_attention`` (None: its default), whether the torch backend runs the compiled CPU
    kernel."""
    if name not in BACKEND_NAMES:
        raise ConfigError(f"attention backend {name!r} is unknown; use one of {', '.join(BACKEND_NAMES)}")
    on_cuda = torch.device(device).type == "cuda"
    if name == "auto" and on_cuda and not batch_invariant:
        name = "flashinfer" if flashinfer_available() else "triton"
    if name in ("flashinfer", "triton") and (not on_cuda or not torch.cuda.is_available()):
        raise ConfigError(
            f"the {name} attention backend needs a CUDA device; got device {str(device)!r} "
            f"(CUDA available: {torch.cuda.is_available()}); use backend 'torch' on CPU"
        )
    if name == "flashinfer":
        from warmcap.runner_v2.attention.flashinfer import FlashInferAttention

        return FlashInferAttention(torch.device(device))
    if name == "triton":
        from warmcap.kernels.triton.paged_attention import TritonPagedAttention

        return TritonPagedAttention()
    return TorchPagedAttention(device, batch_invariant=batch_invariant, cpu_attention=cpu_attention)


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
