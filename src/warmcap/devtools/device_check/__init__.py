"""Device validation of the graph path, as importable checks: ``scripts/gpu_check.py`` runs them on a
CUDA device, and CI runs the same code on CPU (``static`` graphs, tiny presets), so a renamed
method fails a test instead of the next GPU session.

A check is a function of a :class:`CheckContext` returning a JSON-ready dict with an ``ok`` key
(and optionally ``summary``: readable lines, ``skipped``: why it did not run). Checks live in the
registry :data:`CHECKS`, in the order they run; add one with the :func:`check` decorator::

    @check("attention_triton")
    def attention_triton(ctx: CheckContext) -> dict[str, Any]:
        ...
        return {"ok": equal, "summary": [f"triton paged attention == torch: {equal}"]}

A new area's checks go in a module of this package that this file imports (importing it
registers them; the import order is the run order). ``cuda_only=True`` checks report ``skipped`` off CUDA (the script exits 2 without CUDA anyway).
:func:`run_checks` runs a selection, turns an exception into that check's failure (one broken
check never hides the others) and :func:`summary_lines` renders the results.

Built in:
- ``engines`` (``engines.py``): per engine case and attention backend (torch; FlashInfer when importable), build the
  engine, generate greedily, capture every target and drafter graph with the device's backend,
  verify each (I4), time replay against the eager forward on the same static inputs, generate
  again: tokens identical, target graphs replayed (drafter graphs too when it has any);
- ``slot_mapping`` (CUDA, ``kernels.py``): the Triton slot-mapping kernel, compiled for real, against torch;
- ``tensor_parallel`` (CUDA, 2+ GPUs, ``startup_checks.py``): ``warmup run`` at TP=2 audited and verified on both ranks,
  greedy TP=2 == TP=1;
- ``audit_cost`` (``startup_checks.py``): start-up with the warmup audit and without it (``--no-audit``), same engine;
- ``host_syncs`` (CUDA, ``kernels.py``): synchronising CUDA calls a decode step (one: the step's token fetch);
- ``paged_attention`` (CUDA, ``attention.py``): the Triton and FlashInfer paged-attention backends
  against the torch reference on NaN-poisoned layouts, in a CUDA graph, timed, and two engines on Triton;
- ``fused_ops`` (CUDA, ``fused.py``): the fused layer ops against torch, kernels a layer of a
  SmolLM2 decode step with and without them, tokens compared.
"""

from __future__ import annotations

from warmcap.devtools.device_check import attention, engines, fused, kernels, startup_checks
from warmcap.devtools.device_check.registry import (
    CHECKS,
    Check,
    CheckContext,
    EngineCase,
    check,
    out_path,
    run_checks,
    summary_lines,
)

__all__ = [
    "CHECKS",
    "Check",
    "CheckContext",
    "EngineCase",
    "attention",
    "check",
    "engines",
    "fused",
    "kernels",
    "out_path",
    "run_checks",
    "startup_checks",
    "summary_lines",
]
