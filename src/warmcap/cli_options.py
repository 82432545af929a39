"""The ``warmup`` commands' shared options: one ``Annotated`` type per option, so every command
spells, documents and defaults it the same way.

Engine options come from the table in ``engine_args.py`` (their help text included): a command
declares a parameter named after the table entry with the type below, and ``cli.engine_config``
hands every such parameter to ``engine_args.build_config``.

Defaults. ``warmup plan`` and ``warmup run`` describe one engine, so they share :data:`STARTUP`
(a small start-up that finishes in seconds on a CPU, with a drafter that writes KV so the audit
has draft passes to check); ``warmup plan`` with a run's flags prints the plan that run executes.
``warmup serve`` sizes for serving (:data:`SERVE`: the model's context, and the sequences and step
budget vLLM's OpenAI server takes on the device, ``engine_args.serving_batch_defaults``: 128 and
2048 on CPU). ``warmup generate`` sizes for its one request (its help says how).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import Annotated, Any

import typer

from warmcap.engine_args import ARGS_BY_NAME, ENGINE_ARGS, SPEC_HELP


@dataclass(frozen=True, slots=True)
class CommandDefaults:
    """The sizing defaults of a group of commands."""

    speculative_config: str
    #: None: computed by the command (``generate``: from the prompt; ``serve``: for the device)
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    max_model_len: int | None


#: ``warmup plan`` and ``warmup run``: the engine a quick start-up builds (documented in README)
STARTUP = CommandDefaults(
    speculative_config="draft_model:2", max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024
)
#: ``warmup generate``: sized for its one request (a None here is computed from the prompt)
GENERATE = CommandDefaults(
    speculative_config="none", max_num_seqs=1, max_num_batched_tokens=None, max_model_len=None
)
#: ``warmup serve``: sized for serving (the batch limits: vLLM's server defaults for the device)
SERVE = CommandDefaults(
    speculative_config="none", max_num_seqs=None, max_num_batched_tokens=None, max_model_len=None
)


def _engine(name: str, *flags: str, help_suffix: str = "", **option: Any) -> Any:
    """A ``typer.Option`` for the engine option ``name``, with the table's help text."""
    return typer.Option(*flags, help=ARGS_BY_NAME[name].help + help_suffix, **option)


MODEL_HELP = "Preset name (smollm2-135m, tiny-llama, tiny-qwen3, ...) or a local HF directory."

# ---- engine options (engine_args.ENGINE_ARGS) -----------------------------------------------------
Model = Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)]
Spec = Annotated[str, typer.Option("--spec", "--speculative-config", "-s", help=SPEC_HELP)]
Dtype = Annotated[str, _engine("dtype")]
Device = Annotated[str, _engine("device")]
EnforceEager = Annotated[bool, _engine("enforce_eager", "--enforce-eager")]
BatchInvariant = Annotated[bool, _engine("batch_invariant", "--batch-invariant")]
AttentionBackend = Annotated[str, _engine("attention_backend")]
BlockSize = Annotated[int, _engine("block_size")]
NumBlocks = Annotated[int | None, _engine("num_blocks")]
GpuMemoryUtilization = Annotated[float, _engine("gpu_memory_utilization")]
KvCacheSpace = Annotated[float | None, _engine("kv_cache_space", metavar="GIB")]
EnablePrefixCaching = Annotated[
    bool | None, _engine("enable_prefix_caching", "--enable-prefix-caching/--no-enable-prefix-caching")
]
MambaCacheMode = Annotated[str, _engine("mamba_cache_mode")]
MaxNumSeqs = Annotated[int | None, _engine("max_num_seqs")]
MaxNumBatchedTokens = Annotated[int | None, _engine("max_num_batched_tokens")]


def _max_model_len(value: str | None) -> int | None:
    if value is None or value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(
            f"{value!r} is not a number of tokens: give one, e.g. 4096, or auto for the model's own limit"
        ) from None


MaxModelLen = Annotated[
    int | None,
    typer.Option(
        parser=_max_model_len,
        metavar="N|auto",
        help=ARGS_BY_NAME["max_model_len"].help,
    ),
]
EnableChunkedPrefill = Annotated[
    bool, _engine("enable_chunked_prefill", "--enable-chunked-prefill/--no-enable-chunked-prefill")
]
AsyncScheduling = Annotated[
    bool | None, _engine("async_scheduling", "--async-scheduling/--no-async-scheduling")
]
KvRole = Annotated[str, _engine("kv_role")]
KvTransferConfig = Annotated[str | None, _engine("kv_transfer_config")]
TensorParallelSize = Annotated[int, _engine("tensor_parallel_size", "--tensor-parallel-size", "-tp")]
CpuThreads = Annotated[int | None, _engine("cpu_threads")]
CpuThreadsBind = Annotated[str, _engine("cpu_threads_bind")]

# ---- start-up options (warmup run, warmup serve) ---------------------------------------------------
Backend = Annotated[
    str | None,
    typer.Option(help="Graph backend: cuda, static or compile (default: cuda on a GPU, else static)."),
]
CaptureSizes = Annotated[
    str | None, typer.Option(help="Comma-separated token counts to capture, e.g. 1,2,4,8.")
]
Audit = Annotated[
    bool,
    typer.Option(
        "--audit/--no-audit",
        help="Audit every KV write warmup makes (default: on, on every device); --no-audit skips it and "
        "the report says 'audit off'.",
    ),
]
AuditServing = Annotated[
    bool,
    typer.Option(
        "--audit-serving",
        help="Audit the KV writes of every serving step, as warmup is audited; a step that writes outside "
        "its blocks fails with the request, group, position and slot (slower: a debugging and CI switch).",
    ),
]
Html = Annotated[
    str | None,
    typer.Option(
        "--html",
        help="Also write a self-contained HTML page to this file: the plan's block layouts (plan), "
        "the report with the warmup steps' block grids and audited writes (run, report), or the diff "
        "side by side (report --diff).",
    ),
]
Quiet = Annotated[
    bool, typer.Option("--quiet", "-q", help="No start-up progress and only errors from the log (stderr).")
]
Verbose = Annotated[
    bool,
    typer.Option(
        "--verbose", "-v", help="Log each start-up phase (INFO, stderr) besides the progress display."
    ),
]


#: the ``Annotated`` type of each engine option, by its name in ``engine_args.ENGINE_ARGS``
ENGINE_OPTION_TYPES: dict[str, Any] = {
    "speculative_config": Spec,
    "dtype": Dtype,
    "device": Device,
    "enforce_eager": EnforceEager,
    "batch_invariant": BatchInvariant,
    "attention_backend": AttentionBackend,
    "block_size": BlockSize,
    "num_blocks": NumBlocks,
    "gpu_memory_utilization": GpuMemoryUtilization,
    "kv_cache_space": KvCacheSpace,
    "enable_prefix_caching": EnablePrefixCaching,
    "mamba_cache_mode": MambaCacheMode,
    "max_num_seqs": MaxNumSeqs,
    "max_num_batched_tokens": MaxNumBatchedTokens,
    "max_model_len": MaxModelLen,
    "enable_chunked_prefill": EnableChunkedPrefill,
    "async_scheduling": AsyncScheduling,
    "kv_role": KvRole,
    "kv_transfer_config": KvTransferConfig,
    "tensor_parallel_size": TensorParallelSize,
    "cpu_threads": CpuThreads,
    "cpu_threads_bind": CpuThreadsBind,
}


def option_default(name: str, defaults: CommandDefaults) -> Any:
    """A command's default for the engine option ``name``: its group's sizing default, else the
    config's own (so the command line and ``LLM()`` start from the same values)."""
    from warmcap.config import EngineConfig

    if hasattr(defaults, name):
        return getattr(defaults, name)
    arg = ARGS_BY_NAME[name]
    if arg.part is None:
        return {"kv_transfer": None, "speculative": "none"}.get(arg.attr, getattr(EngineConfig(), arg.attr))
    return getattr(getattr(EngineConfig(), arg.part), arg.attr)


def engine_options(defaults: CommandDefaults) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command every engine option of the table that it does not declare itself.

    The command takes them as ``**engine`` keyword arguments; ``cli.engine_config`` turns its own
    engine parameters and those into one :class:`EngineConfig`.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        names = {p.name for p in own}
        missing = [a.name for a in ENGINE_ARGS if a.cli and a.name not in names]
        if set(missing) - set(ENGINE_OPTION_TYPES):
            raise TypeError(
                f"engine options without a command-line type: {set(missing) - set(ENGINE_OPTION_TYPES)}"
            )
        added = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=ENGINE_OPTION_TYPES[name],
                default=option_default(name, defaults),
            )
            for name in missing
        ]

        @wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        wrapper.__signature__ = sig.replace(parameters=own + added)  # type: ignore[attr-defined]
        return wrapper

    return decorate
