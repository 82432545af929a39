"""The device checks' registry, context and runner (:mod:`warmcap.devtools.device_check`)."""

from __future__ import annotations

import datetime as dt
import json
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from warmcap import env

CheckFn = Callable[["CheckContext"], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class EngineCase:
    """One engine to check: preset, dtype, speculative spec, fixed-shape GEMMs."""

    model: str
    dtype: str
    spec: str | None = None
    batch_invariant: bool = False

    @property
    def label(self) -> str:
        return f"{self.model} {self.dtype} spec={self.spec}" + (
            " batch_invariant" if self.batch_invariant else ""
        )


#: what ``scripts/gpu_check.py`` runs on a GPU. MLA + MoE, sparse MLA and the Mamba hybrid are
#: graph-safe on CPU's fake-tensor check; the cuda plan leaves the hybrid's ragged passes eager.
GPU_ENGINES: tuple[EngineCase, ...] = (
    EngineCase("tiny-llama", "float32"),
    EngineCase("tiny-llama", "float32", "ngram:2"),
    EngineCase("tiny-llama", "float32", "draft_model:2"),
    EngineCase("tiny-llama", "float32", "eagle3:2"),
    EngineCase("tiny-llama", "float32", "dflash:2"),
    EngineCase("smollm2-135m", "bfloat16"),
    EngineCase("smollm2-135m", "bfloat16", "draft_model:2"),
    EngineCase("tiny-deepseek-v3", "float32"),
    EngineCase("tiny-deepseek-v3", "float32", "mtp:2"),
    EngineCase("tiny-deepseek-v32", "float32"),
    EngineCase("tiny-hybrid", "float32", "ngram:2"),
    EngineCase("tiny-hybrid", "float32", "draft_model:2@self"),
    # Fixed-shape GEMM tiles: real rows of every graph match the unpadded eager batch far tighter.
    EngineCase("smollm2-135m", "float32", "draft_model:2", batch_invariant=True),
)
PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Count: one, two, three,",
    "def add(a, b):",
    "Once upon a time",
)


#: the engine ``audit_cost`` starts with and without the audit on a GPU
AUDIT_CASE = EngineCase("smollm2-135m", "bfloat16", "draft_model:2")


@dataclass(slots=True)
class CheckContext:
    """What every check reads: the device, the graph backend, the engines and their sizes."""

    device: torch.device
    engines: Sequence[EngineCase] = GPU_ENGINES
    #: attention backends the engine check runs each case on
    attentions: Sequence[str] = ("torch",)
    #: graph backend (default: ``cuda`` on a CUDA device, else ``static``)
    backend: str = ""
    #: capture the graphs this backend plans (``static`` capture of the ``cuda`` plan on CPU)
    plan_backend: str | None = None
    #: mixed-graph ladder (None: the default one)
    capture_sizes: Sequence[int] | None = None
    prompts: Sequence[str] = PROMPTS
    max_tokens: int = 24
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    max_model_len: int = 512
    num_blocks: int = 1024
    mamba_cache_mode: str = "none"
    timing_iters: int = 20
    #: the engine whose start-up is timed with and without the audit
    audit_case: EngineCase = AUDIT_CASE
    #: progress lines (the script prints them)
    log: Callable[[str], None] = field(default=lambda line: None)
    #: print each engine's capture report (rich) as it is made
    render_reports: bool = False

    def __post_init__(self) -> None:
        if not self.backend:
            self.backend = "cuda" if self.device.type == "cuda" else "static"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.is_cuda else str(self.device)

    def startup(self, *, audit: bool = True) -> Any:
        """The start-up options of a check's engine: this context's backend and sizes, every graph
        verified afresh (no verdict cache: a check measures, it does not reuse)."""
        from warmcap.config import StartupOptions

        sizes = None if self.capture_sizes is None else tuple(self.capture_sizes)
        return StartupOptions(backend=self.backend, capture_sizes=sizes, audit=audit, startup_cache=False)

    def config(self, case: EngineCase, *, attention: str = "auto", tensor_parallel_size: int = 1) -> Any:
        """The engine config of ``case``, built through the front door every user takes
        (``engine_args.build_config``, as ``LLM(...)`` and the commands build theirs)."""
        from warmcap.engine_args import build_config

        return build_config(
            case.model,
            dtype=case.dtype,
            device=self.device.type,
            batch_invariant=case.batch_invariant,
            attention_backend=attention,
            block_size=16,
            num_blocks=self.num_blocks,
            mamba_cache_mode=self.mamba_cache_mode,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            speculative_config=case.spec,
            tensor_parallel_size=tensor_parallel_size,
        )


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    run: CheckFn
    cuda_only: bool = False


#: every check, by name, in the order :func:`run_checks` runs them
CHECKS: dict[str, Check] = {}


def check(name: str, *, cuda_only: bool = False) -> Callable[[CheckFn], CheckFn]:
    """Register ``fn`` as the check ``name`` (a name may be registered once)."""

    def register(fn: CheckFn) -> CheckFn:
        if name in CHECKS:
            raise ValueError(f"device check {name!r} is registered twice")
        CHECKS[name] = Check(name, fn, cuda_only)
        return fn

    return register


def run_checks(ctx: CheckContext, names: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the checks ``names`` (default: all) and return one JSON-ready dict: environment facts,
    ``checks`` (name -> result) and ``ok`` (every check passed or was skipped)."""
    unknown = sorted(set(names or ()) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown device check(s) {unknown}: known are {', '.join(CHECKS)}")
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": ctx.device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "backend": ctx.backend,
        "plan_backend": ctx.plan_backend or ctx.backend,
        "attentions": list(ctx.attentions),
        "checks": {},
    }
    for name, entry in CHECKS.items():
        if names is not None and name not in names:
            continue
        ctx.log(f"\n=== {name}")
        t0 = time.perf_counter()
        if entry.cuda_only and not ctx.is_cuda:
            result: dict[str, Any] = {"ok": True, "skipped": f"needs CUDA; ran on {ctx.device}"}
        else:
            try:
                result = entry.run(ctx)
            except Exception as exc:
                ctx.log(traceback.format_exc())
                result = {"ok": False, "error": repr(exc)}
        result["seconds"] = time.perf_counter() - t0
        results["checks"][name] = result
    results["ok"] = all(r["ok"] for r in results["checks"].values())
    return results


def summary_lines(results: dict[str, Any]) -> list[str]:
    """One PASS/FAIL/SKIP line per check, then that check's own summary lines, indented."""
    lines = [f"{results['device']}  torch {results['torch']}  backend {results['backend']}"]
    for name, r in results["checks"].items():
        verdict = "SKIP" if "skipped" in r else "PASS" if r["ok"] else "FAIL"
        tail = f"  ({r['skipped']})" if "skipped" in r else f"  error: {r['error']}" if "error" in r else ""
        lines.append(f"{verdict}  {name}  {r['seconds']:.1f}s{tail}")
        lines += [f"    {line}" for line in r.get("summary", [])]
    lines.append(f"{'ALL PASSED' if results['ok'] else 'SOME CHECKS FAILED'}")
    return lines


def timed(ctx: CheckContext, fn: Callable[[], Any], iters: int) -> float:
    """Mean seconds a call after one warm call, synchronised on CUDA."""
    fn()
    ctx.sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    ctx.sync()
    return (time.perf_counter() - start) / iters


def out_path(results: dict[str, Any], name: str = "gpu_check.json") -> str | None:
    """Write ``results`` as JSON into ``$OUT`` when it is set; the path written, else None."""
    out_dir = env.read("OUT")
    if not out_dir:
        return None
    path = Path(out_dir) / name
    path.write_text(json.dumps(results, indent=2, default=str))
    return str(path)
