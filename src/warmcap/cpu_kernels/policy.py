"""When a compiled CPU kernel is used: the switch each kernel family has (``auto``, ``torch``,
``kernel``) and the tensors a kernel may be handed.

``auto`` (the default) uses the kernel when it builds and falls back to torch with one warning when
it does not; ``torch`` never uses it; ``kernel`` requires it and fails start-up when it cannot be
built.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Literal

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from warmcap.cpu_kernels.build import KernelBuildError, load_library
from warmcap.errors import ConfigError

Mode = Literal["auto", "torch", "kernel"]
MODES: tuple[Mode, ...] = ("auto", "torch", "kernel")
#: the tensor types a kernel may read: plain tensors and parameters (not fakes or other subclasses)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def kernel_mode(env: str) -> Mode:
    """The mode ``$env`` asks for (``auto`` when unset)."""
    value = os.environ.get(env, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ConfigError(f"{env}={value!r} is not a CPU kernel mode; use one of {', '.join(MODES)}")
    return value  # type: ignore[return-value]


def load_by_mode(
    env: str, source: str, *, what: str, instead: str, log: logging.Logger
) -> ctypes.CDLL | None:
    """The library built from ``source`` as ``$env`` allows: None in ``torch`` mode, or in ``auto``
    mode when it cannot be built (then one warning on ``log`` naming ``what`` is unavailable and
    ``instead`` runs); ``kernel`` mode raises :class:`ConfigError` instead."""
    mode = kernel_mode(env)
    if mode == "torch":
        return None
    try:
        return load_library(source)
    except KernelBuildError as exc:
        if mode == "kernel":
            raise ConfigError(f"{env}=kernel but {what} cannot be built: {exc}") from exc
        log.warning("%s is unavailable, using %s (set %s=torch to silence): %s", what, instead, env, exc)
        return None


def plain_cpu_tensors(*tensors: torch.Tensor) -> bool:
    """Whether a kernel reading raw pointers may be handed these tensors: float32 CPU tensors (or
    parameters) that are not fake, with nothing tracing the call and no gradient to record.

    NOTE: fake tensors (``graphs/proof/safety.py``) have no data, and ``torch.compile`` (the
    ``compile`` graph backend) would break its graph around every opaque call: both keep torch's ops,
    as CUDA does.
    """
    grad = torch.is_grad_enabled()
    for x in tensors:
        if type(x) not in _PLAIN or x.device.type != "cpu" or x.dtype != torch.float32:
            return False
        if grad and x.requires_grad:
            return False
    return not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
