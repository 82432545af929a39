"""One table from flat engine options to an :class:`EngineConfig`.

``LLM(**kwargs)``, the ``warmup`` commands (``plan``, ``run``, ``generate``, ``serve``) and so the
server all name an engine setting the same way — vLLM's keyword — and turn it into the config
through :func:`build_config` alone. A setting added to :data:`ENGINE_ARGS` reaches every surface:
``LLM`` accepts it, and every engine command gets a ``--flag`` for it (``cli_options.py``);
``tests/test_engine_args.py`` holds each surface to that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from warmcap.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KERNEL_CHOICES,
    KV_ROLES,
    MAMBA_CACHE_MODES,
    CacheConfig,
    EngineConfig,
    KernelConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from warmcap.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EngineArg:
    """One flat engine option, declared once: its name (``LLM`` keyword; ``--name-with-dashes`` on
    the command line), where it lands in :class:`EngineConfig` (``part`` None: a field of the
    config itself), the help the command line shows and how the command line reads it
    (``cli_options.py`` builds every command's option from this record alone)."""

    name: str
    part: str | None
    attr: str
    help: str
    #: the command-line value's type (None: not given, the config's default)
    cli_type: Any = str
    #: the command line's spellings (empty: ``--name-with-dashes``; a bool flag: ``--on/--off``)
    flags: tuple[str, ...] = ()
    metavar: str | None = None
    #: turns the command line's text into the value (raises ConfigError with the advice)
    parse: Callable[[str], Any] | None = None
    #: shown on the command line (``seed`` is not: ``warmup generate --seed`` is the request's)
    cli: bool = True
    #: the same setting under another ``LLM`` keyword (vLLM's), refused when given together
    alias: str | None = None


SPEC_HELP = (
    "Speculative decoding: METHOD[:K]\\[@DRAFT] (e.g. eagle3:3, dflash:7, draft_model:3@./draft), "
    'vLLM JSON such as \'{"method": "ngram", "num_speculative_tokens": 4}\', or none.'
)
KV_TRANSFER_HELP = (
    'P/D KV transfer as JSON, e.g. \'{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}\' '
    "(roles: kv_producer, kv_consumer, kv_both; sets --kv-role)."
)

#: ``--max-model-len auto``: the model's own limit (``build_config`` reads it as None)
AUTO = "auto"


def parse_max_model_len(text: str) -> int | str:
    """``--max-model-len``: a number of tokens, or ``auto`` for the model's own limit."""
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"{text!r} is not a number of tokens: give one, e.g. 4096, or auto for the model's own limit"
        ) from None


def _kernel_help(what: str, name: str) -> str:
    """The help of the kernel setting ``name``: its values and the variable that defaults it."""
    choices, variable = KERNEL_CHOICES[name]
    return f"{what}: {', '.join(choices)} (default: ${variable}, else {choices[0]})."


ENGINE_ARGS: tuple[EngineArg, ...] = (
    EngineArg(
        "dtype",
        "model",
        "dtype",
        f"Weights and KV dtype: {', '.join(DTYPES)} or auto (the checkpoint's on CUDA, float32 on CPU).",
    ),
    EngineArg(
        "device",
        "model",
        "device",
        "Device to run on (and whose free memory sizes the pool): auto, cpu or cuda[:N].",
    ),
    EngineArg("seed", "model", "seed", "Seed of the engine's random state.", int, cli=False),
    EngineArg(
        "enforce_eager",
        "model",
        "enforce_eager",
        "Capture no graphs: every step runs eagerly (start-up is faster); --capture-graphs: capture them.",
        bool | None,
        ("--enforce-eager/--capture-graphs",),
    ),
    EngineArg(
        "batch_invariant",
        "model",
        "batch_invariant",
        "Fixed-shape GEMM tiles: a token's output never depends on its batch, so graph replays equal "
        "eager steps bit for bit (slower; Llama-family models).",
        bool,
        ("--batch-invariant",),
    ),
    EngineArg(
        "attention_backend",
        "model",
        "attention_backend",
        f"Attention of full and sliding-window layers: {', '.join(ATTENTION_BACKENDS)}.",
    ),
    EngineArg("block_size", "cache", "block_size", "Tokens per KV block (a power of two).", int),
    EngineArg(
        "num_blocks",
        "cache",
        "num_blocks",
        "KV pool size in blocks, null block included (default: sized from memory).",
        int | None,
    ),
    EngineArg(
        "gpu_memory_utilization",
        "cache",
        "memory_fraction",
        "Share of the device's free memory the weights and KV pool may take, in (0, 1].",
        float,
        alias="memory_fraction",
    ),
    EngineArg(
        "kv_cache_space",
        "cache",
        "kv_cache_space_gib",
        "KV cache space in GiB (default on CPU: $VLLM_CPU_KVCACHE_SPACE, else 4, as vLLM's CPU build; "
        "on CUDA the pool takes --gpu-memory-utilization of free memory instead). Pages are touched "
        "only as requests write them.",
        float | None,
        metavar="GIB",
    ),
    EngineArg(
        "enable_prefix_caching",
        "cache",
        "enable_prefix_caching",
        "Prefix caching: on (refused for a model that cannot serve hits), off, or unset (on where "
        "every KV group can serve hits).",
        bool | None,
        ("--enable-prefix-caching/--no-enable-prefix-caching",),
    ),
    EngineArg(
        "mamba_cache_mode",
        "cache",
        "mamba_cache_mode",
        f"Mamba state caching: {', '.join(MAMBA_CACHE_MODES)}.",
    ),
    EngineArg(
        "max_num_seqs",
        "scheduler",
        "max_num_seqs",
        "Most requests in one step (sets warmup and the graph sizes).",
        int | None,
    ),
    EngineArg(
        "max_num_batched_tokens",
        "scheduler",
        "max_num_batched_tokens",
        "Token budget of one step.",
        int | None,
    ),
    EngineArg(
        "max_prefill_tokens_with_decodes",
        "scheduler",
        "max_prefill_tokens_with_decodes",
        "Most prompt tokens a step computes while requests decode, so a burst of prompts cannot stall "
        "their next tokens for a whole budget's prefill (a step with nothing decoding keeps the whole "
        "budget; needs chunked prefill); 0 or unset: no cap.",
        int | None,
    ),
    EngineArg(
        "max_model_len",
        "scheduler",
        "max_model_len",
        "Context limit in tokens; None (auto on the command line): the model's own (max_position_embeddings).",
        int | None,
        metavar="N|auto",
        parse=parse_max_model_len,
    ),
    EngineArg(
        "enable_chunked_prefill",
        "scheduler",
        "enable_chunked_prefill",
        "Split long prompts over steps to fit the token budget.",
        bool,
        ("--enable-chunked-prefill/--no-enable-chunked-prefill",),
    ),
    EngineArg(
        "async_scheduling",
        "scheduler",
        "async_scheduling",
        "One step in flight: schedule the next step while this one runs and read its tokens "
        "afterwards (unset: on for one CUDA device without P/D or Mamba state, off elsewhere; same "
        "tokens either way).",
        bool | None,
        ("--async-scheduling/--no-async-scheduling",),
    ),
    EngineArg(
        "cpu_gemm",
        "kernel",
        "cpu_gemm",
        _kernel_help("Compiled CPU GEMM for linear layers", "cpu_gemm")
        + " torch: oneDNN's; kernel: fail start-up when it cannot be built.",
        str | None,
    ),
    EngineArg(
        "cpu_layer_ops",
        "kernel",
        "cpu_layer_ops",
        _kernel_help("Compiled CPU layer ops (RMSNorm, SiLU-mul, RoPE)", "cpu_layer_ops"),
        str | None,
    ),
    EngineArg(
        "cpu_attention",
        "kernel",
        "cpu_attention",
        _kernel_help("Compiled CPU paged attention", "cpu_attention") + " torch: gather + SDPA.",
        str | None,
    ),
    EngineArg(
        "cpu_isa",
        "kernel",
        "cpu_isa",
        _kernel_help("Instruction set the CPU kernels are compiled for", "cpu_isa") + " One per process.",
        str | None,
    ),
    EngineArg(
        "exact_greedy_head",
        "kernel",
        "exact_greedy_head",
        _kernel_help("Screened exact greedy head on CPU (off: full logits every step)", "exact_greedy_head"),
        str | None,
    ),
    EngineArg(
        "fused_ops",
        "kernel",
        "fused_ops",
        _kernel_help("Fused Triton layer ops on CUDA", "fused_ops"),
        str | None,
    ),
    EngineArg(
        "tp_comm",
        "kernel",
        "tp_comm",
        _kernel_help("Collectives of the tensor-parallel ranks of one machine", "tp_comm")
        + " auto: shared memory on CPU, NCCL on CUDA.",
        str | None,
    ),
    EngineArg(
        "tp_balance",
        "kernel",
        "tp_balance",
        _kernel_help("Two tensor-parallel ranks with uneven attention heads", "tp_balance")
        + " auto: the rank with fewer heads projects the other's K/V too (same bits); heads: each its own.",
        str | None,
    ),
    EngineArg(
        "speculative_config", None, "speculative", SPEC_HELP, str, ("--spec", "--speculative-config", "-s")
    ),
    EngineArg("kv_role", None, "kv_role", f"P/D role: {', '.join(KV_ROLES)}."),
    EngineArg("kv_transfer_config", None, "kv_transfer", KV_TRANSFER_HELP, str | None),
    EngineArg(
        "tensor_parallel_size",
        None,
        "tensor_parallel_size",
        "Ranks to shard the model over: rank 0 is this process, ranks 1..N-1 are spawned workers "
        "(gloo on CPU, NCCL on CUDA); with RANK set (torchrun, several machines) every rank is started "
        "by the launcher and the command on RANK > 0 serves as a worker.",
        int,
        ("--tensor-parallel-size", "-tp"),
    ),
    EngineArg(
        "cpu_threads",
        None,
        "cpu_threads",
        "Model threads of each rank on CPU (default: torch's count with one rank; with several, the "
        "cores this process may use split evenly across the ranks).",
        int | None,
    ),
    EngineArg(
        "cpu_threads_bind",
        None,
        "cpu_threads_bind",
        "Where CPU model threads run: auto (each pinned to a core of its rank's share), none (left to the "
        "OS), or CPU lists such as 0-1, one per rank separated by | (0|1).",
    ),
)

ARGS_BY_NAME: dict[str, EngineArg] = {a.name: a for a in ENGINE_ARGS}
_ALIASES: dict[str, EngineArg] = {a.alias: a for a in ENGINE_ARGS if a.alias}
#: every keyword :func:`build_config` (and so ``LLM``) takes besides the model
ENGINE_KWARGS: tuple[str, ...] = (*ARGS_BY_NAME, *_ALIASES)
CONFIG_PARTS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "kernel": KernelConfig,
}


def build_config(model: str, **kwargs: Any) -> EngineConfig:
    """An :class:`EngineConfig` from flat options named as in :data:`ENGINE_ARGS`.

    An error names the option as the caller spelled it (``gpu_memory_utilization``, not the
    config's ``memory_fraction``). ``dtype="auto"`` is resolved here (:func:`auto_dtype`).
    """
    unknown = sorted(set(kwargs) - set(ENGINE_KWARGS))
    if unknown:
        raise ConfigError(f"unknown engine argument(s) {unknown}; valid: {', '.join(sorted(ENGINE_KWARGS))}")
    given: dict[str, tuple[str, Any]] = {}  # canonical name -> (name as given, value)
    for name, value in kwargs.items():
        arg = ARGS_BY_NAME.get(name) or _ALIASES[name]
        if arg.name in given:
            other = given[arg.name]
            raise ConfigError(
                f"{other[0]} and {name} name the same setting: pass only one (got {other[1]} and {value})"
            )
        given[arg.name] = (name, value)
    if given.get("dtype", (None, None))[1] == "auto":
        device = given.get("device", (None, "auto"))[1]
        given["dtype"] = ("dtype", auto_dtype(model, device))
    if given.get("max_model_len", (None, None))[1] == AUTO:
        given["max_model_len"] = (given["max_model_len"][0], None)
    parts: dict[str, dict[str, Any]] = {part: {} for part in CONFIG_PARTS}
    parts["model"]["model"] = model
    spelled: dict[str, str] = {}
    for canonical, (name, value) in given.items():
        arg = ARGS_BY_NAME[canonical]
        if arg.part == "kernel" and value is None:
            continue  # unset: the field's own default (its environment variable)
        if arg.part is not None:
            parts[arg.part][arg.attr] = value
            spelled[arg.attr] = name
    built = {part: _build_part(cls, parts[part], spelled) for part, cls in CONFIG_PARTS.items()}

    def top(name: str, default: Any) -> Any:
        return given.get(name, (name, default))[1]

    return EngineConfig(
        model=built["model"],
        cache=built["cache"],
        scheduler=built["scheduler"],
        kernel=built["kernel"],
        speculative=SpeculativeConfig.parse(top("speculative_config", None)),
        kv_role=top("kv_role", "none"),
        kv_transfer=KVTransferConfig.parse(top("kv_transfer_config", None)),
        tensor_parallel_size=top("tensor_parallel_size", 1),
        cpu_threads=top("cpu_threads", None),
        cpu_threads_bind=top("cpu_threads_bind", "auto"),
    )


def _build_part(cls: type, values: dict[str, Any], spelled: dict[str, str]) -> Any:
    """``cls(**values)``; a refusal that names a config field the caller spelled otherwise is
    re-worded with the caller's name."""
    try:
        return cls(**values)
    except ConfigError as exc:
        message = str(exc)
        for attr, name in spelled.items():
            if name != attr and message.startswith(attr):
                raise ConfigError(name + message[len(attr) :]) from None
        raise


#: vLLM's OpenAI-server defaults (``max_num_seqs``, ``max_num_batched_tokens``): CPU (per rank), and
#: CUDA below / from 70 GiB of device memory (an A100 stays on the smaller pair)
SERVING_BATCH_CPU = (128, 2048)
SERVING_BATCH_GPU = (256, 2048)
SERVING_BATCH_BIG_GPU = (1024, 8192)
_BIG_GPU_BYTES = 70 << 30
#: ``warmup serve``'s prompt allowance beside decodes on CPU (``max_prefill_tokens_with_decodes``),
#: where a 2048-token step is seconds of forward; per rank, like the budget. CUDA keeps none (a
#: whole budget's prefill there is milliseconds). Measured in BENCHMARKS.md ("the prompt allowance").
SERVING_PREFILL_WITH_DECODES_CPU = 512


def serving_batch_defaults(
    device: str = "auto", tensor_parallel_size: int = 1
) -> tuple[int, int, int | None]:
    """``(max_num_seqs, max_num_batched_tokens, max_prefill_tokens_with_decodes)`` a server takes
    when not told: the first two as vLLM's OpenAI server picks them for the device, the prompt
    allowance :data:`SERVING_PREFILL_WITH_DECODES_CPU` on CPU and None on CUDA (``warmup serve``;
    ``LLM`` keeps the config's own)."""
    from warmcap.assembly import resolve_device

    resolved = resolve_device(device)
    if resolved.type != "cuda":
        seqs, tokens = SERVING_BATCH_CPU
        tp = tensor_parallel_size
        return seqs * tp, tokens * tp, SERVING_PREFILL_WITH_DECODES_CPU * tp
    import torch

    props = torch.cuda.get_device_properties(resolved)
    big = props.total_memory >= _BIG_GPU_BYTES and "a100" not in props.name.lower()
    return (*(SERVING_BATCH_BIG_GPU if big else SERVING_BATCH_GPU), None)


def auto_dtype(model: str, device: str = "auto") -> str:
    """``dtype="auto"``: the checkpoint's own dtype (``torch_dtype`` in its config.json, float32 when
    absent) on CUDA, and float32 on CPU.

    NOTE: vLLM's auto runs float32 checkpoints in float16; warmcap keeps float32, and on CPU (its
    reference path, where parity with ``transformers`` is tested) it always computes in float32.
    """
    from warmcap.assembly import resolve_device

    if resolve_device(device).type != "cuda":
        return "float32"
    from warmcap.models.loader import load_hf_config
    from warmcap.models.presets import resolve_model_path

    hf_config = load_hf_config(resolve_model_path(model))
    named = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(named).removeprefix("torch.") if named is not None else "float32"
    return name if name in DTYPES else "float32"
