"""Every environment variable warmcap reads or sets, in one table, and the only module that touches
``os.environ``.

An environment variable is never a setting of its own here. It is one of three things:

- ``default``: the default of a config field (:class:`~warmcap.config.KernelConfig`'s kernel
  switches, the CPU KV space). The field is what the engine reads; ``LLM(...)`` and every command's
  ``--flag`` set it, and the variable only fills it when nothing did. So the config, and the
  start-up verdict cache keyed on it, always say which kernels ran.
- ``process``: a fact about the process or machine that no engine config can own: where caches
  live, the launcher's rank variables (torchrun's), the C compiler, OpenMP's wait policy, the
  thread count a user pinned, Triton's interpreter.
- ``test``: fault injection and rebuild switches for tests and debugging; they never change a
  result that is reported.

``docs/configuration.md`` lists the table; ``tests/test_env.py`` holds the package to it (no other
module names ``os.environ``, every ``WARMCAP_*`` name in the source is in :data:`VARIABLES`, the
docs list each one).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Kind = Literal["default", "process", "test"]


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One variable: its name, what an unset one means, its kind and what it is for (a ``default``
    variable names the config field it fills, as ``section.field``)."""

    name: str
    unset: str
    kind: Kind
    doc: str
    field: str | None = None


_TABLE: tuple[EnvVar, ...] = (
    # ---- defaults of config fields -----------------------------------------------------------------
    EnvVar(
        "WARMCAP_CPU_GEMM", "auto", "default", "compiled CPU GEMM: auto, torch or kernel", "kernel.cpu_gemm"
    ),
    EnvVar(
        "WARMCAP_CPU_LAYER_OPS",
        "auto",
        "default",
        "compiled CPU layer ops (RMSNorm, SiLU-mul, RoPE): auto, torch or kernel",
        "kernel.cpu_layer_ops",
    ),
    EnvVar(
        "WARMCAP_CPU_ATTENTION",
        "auto",
        "default",
        "compiled CPU paged attention: auto, torch or kernel",
        "kernel.cpu_attention",
    ),
    EnvVar(
        "WARMCAP_CPU_ISA",
        "native",
        "default",
        "instruction set the CPU kernels are compiled for: native, avx2, avx512 or baseline",
        "kernel.cpu_isa",
    ),
    EnvVar(
        "WARMCAP_EXACT_GREEDY_HEAD",
        "on",
        "default",
        "screened exact greedy head on CPU: on (also 1), off (also 0) or portable",
        "kernel.exact_greedy_head",
    ),
    EnvVar(
        "WARMCAP_FUSED_OPS",
        "auto",
        "default",
        "fused Triton layer ops on CUDA: auto or torch",
        "kernel.fused_ops",
    ),
    EnvVar(
        "WARMCAP_TP_COMM",
        "auto",
        "default",
        "collectives of the tensor-parallel ranks of one machine: auto, shm or gloo",
        "kernel.tp_comm",
    ),
    EnvVar(
        "WARMCAP_TP_BALANCE",
        "auto",
        "default",
        "two tensor-parallel ranks with uneven attention heads: auto (K/V projected by the rank with "
        "fewer) or heads",
        "kernel.tp_balance",
    ),
    EnvVar(
        "VLLM_CPU_KVCACHE_SPACE",
        "",
        "default",
        "KV cache space in GiB on CPU when --kv-cache-space is not given (vLLM's variable; unset: 4)",
        "cache.kv_cache_space_gib",
    ),
    # ---- facts of the process and the machine ------------------------------------------------------
    EnvVar("WARMCAP_CACHE", "", "process", "the warmcap cache folder (unset: ~/.cache/warmcap)"),
    EnvVar(
        "WARMCAP_STARTUP_CACHE",
        "",
        "process",
        "the start-up verdict cache (unset: startup/ in the warmcap cache)",
    ),
    EnvVar("WARMCAP_API_KEY", "", "process", "`warmup serve --api-key` when the flag is not given"),
    EnvVar("CC", "", "process", "C compiler of the CPU kernels (unset: cc, then gcc)"),
    EnvVar("OMP_NUM_THREADS", "", "process", "a thread count the user pinned: `warmup serve` keeps it"),
    EnvVar(
        "OMP_WAIT_POLICY",
        "",
        "process",
        "OpenMP's wait policy: when set, warmcap leaves GOMP_SPINCOUNT alone",
    ),
    EnvVar(
        "GOMP_SPINCOUNT", "", "process", "libgomp's spins before an idle thread sleeps (warmcap sets 10000)"
    ),
    EnvVar(
        "MKL_ENABLE_INSTRUCTIONS",
        "",
        "process",
        "MKL's dispatch level, which sets a GEMM's rounding (part of the start-up cache key)",
    ),
    EnvVar(
        "TORCHINDUCTOR_CACHE_DIR",
        "",
        "process",
        "inductor's cache (`--backend compile` points it into the start-up cache)",
    ),
    EnvVar("TRITON_INTERPRET", "0", "process", "1: Triton kernels run in its interpreter (CPU tests)"),
    EnvVar("RANK", "", "process", "launcher: this process's global rank"),
    EnvVar("WORLD_SIZE", "", "process", "launcher: ranks in all"),
    EnvVar("LOCAL_RANK", "", "process", "launcher: this process's rank on its machine"),
    EnvVar("LOCAL_WORLD_SIZE", "", "process", "launcher: ranks on this machine"),
    EnvVar("MASTER_ADDR", "", "process", "launcher: rank 0's address"),
    EnvVar("MASTER_PORT", "", "process", "launcher: rank 0's store port"),
    EnvVar("TORCHELASTIC_USE_AGENT_STORE", "", "process", "launcher: torchrun's agent hosts the store"),
    EnvVar("OUT", "", "process", "device checks: folder their JSON results are written to"),
    # ---- tests and debugging -----------------------------------------------------------------------
    EnvVar("WARMCAP_REBUILD", "", "test", "1: rebuild each preset's converted weights once per process"),
    EnvVar(
        "WARMCAP_PD_FAULT_PAUSE_AFTER_POST",
        "",
        "test",
        "P/D fault injection: seconds the decode side sleeps after a request's first READ",
    ),
)

#: every variable warmcap reads or sets, by name
VARIABLES: Mapping[str, EnvVar] = {v.name: v for v in _TABLE}


def _entry(name: str) -> EnvVar:
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(
            f"{name} is not in warmcap.env.VARIABLES: add it there (and to docs/configuration.md)"
        ) from None


def read(name: str) -> str:
    """``$name`` stripped, or the table's value for unset (an empty value counts as unset)."""
    entry = _entry(name)
    value = os.environ.get(name, "").strip()
    return value or entry.unset


def is_set(name: str) -> bool:
    """Whether ``$name`` is set to something other than blanks."""
    _entry(name)
    return bool(os.environ.get(name, "").strip())


def set_default(name: str, value: str) -> None:
    """Set ``$name`` to ``value`` unless it is set: for the process facts warmcap chooses on the
    user's behalf (``GOMP_SPINCOUNT``, ``TORCHINDUCTOR_CACHE_DIR``), which child processes inherit."""
    _entry(name)
    os.environ.setdefault(name, value)


def source(name: str) -> str:
    """How an error names where a value came from: ``$NAME`` when it is set, else empty."""
    return f" (from ${name})" if is_set(name) else ""
