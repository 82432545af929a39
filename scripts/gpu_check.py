"""GPU validation of warmcap's graph path: run on a CUDA machine, record the results with a date.

One call: ``python scripts/gpu_check.py [CHECK ...]`` runs every check of
:mod:`warmcap.devtools.device_check` (engines, slot_mapping, host_syncs, paged_attention, fused_ops,
tensor_parallel, audit_cost), or only the named ones. The checks are importable code that CI also
runs on CPU (``tests/devtools/test_device_check.py``), so this script is only the GPU's settings around them.

Prints a summary; writes ``gpu_check.json`` into ``$OUT`` when that is set. Exit code 0 when every
check passed, 1 when any failed, 2 when there is no CUDA device. Budget: at most 8 minutes on one
H200 (docs/gpu-validation.md).
"""

from __future__ import annotations

import os
import sys

import torch


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available here (torch.cuda.is_available() is False); "
            "run this script on a CUDA machine. Nothing was checked."
        )
        return 2
    from warmcap.devtools.device_check import CHECKS, CheckContext, out_path, run_checks, summary_lines
    from warmcap.runner_v2.attention.selector import flashinfer_available

    unknown = [a for a in argv if a not in CHECKS]
    if unknown:
        print(f"gpu_check: unknown check(s) {unknown}; known: {', '.join(CHECKS)}")
        return 2
    ctx = CheckContext(
        device=torch.device("cuda"),
        attentions=["torch", *(["flashinfer"] if flashinfer_available() else [])],
        mamba_cache_mode=os.environ.get("WARMCAP_MAMBA_MODE", "none"),
        log=lambda line: print(line, flush=True),
        render_reports=True,
    )
    results = run_checks(ctx, argv or None)
    print("\n=== summary")
    for line in summary_lines(results):
        print(line)
    path = out_path(results)
    if path:
        print(f"wrote {path}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
