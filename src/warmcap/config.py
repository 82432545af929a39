"""Engine configuration: one frozen record per concern, derived values as properties.

Derived values (``num_lookahead_tokens``, ``uniform_decode_query_len``) are computed here and only
here; every other module reads them from :class:`EngineConfig`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from warmcap import env
from warmcap.errors import ConfigError
from warmcap.spec_methods import METHODS, SpecMethod, spec_method

SPEC_METHODS: tuple[str, ...] = tuple(METHODS)
KV_ROLES: tuple[str, ...] = ("none", "producer", "consumer")
MAMBA_CACHE_MODES: tuple[str, ...] = ("none", "all", "align")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", "flashinfer")
MAX_SPECULATIVE_TOKENS = 16
#: the KV space a CPU engine takes when neither the option nor ``VLLM_CPU_KVCACHE_SPACE`` says (vLLM's)
DEFAULT_CPU_KV_CACHE_SPACE_GIB = 4.0

KVRole = Literal["none", "producer", "consumer"]
#: ``cpu_threads_bind``: auto, none, or CPU lists ("0-3", "0,2"), one per rank separated by "|"
_CPU_LIST = r"[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*"
_CPU_BIND = re.compile(rf"auto|none|{_CPU_LIST}(\|{_CPU_LIST})*")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which weights to run and how: a preset name or a local HF directory."""

    model: str = "smollm2-135m"
    dtype: str = "float32"
    device: str = "auto"
    seed: int = 0
    # No graph capture at start-up (warmup still runs): the escape hatch vLLM users know.
    enforce_eager: bool = False
    # Fixed-shape GEMM tiles, so a token's output never depends on its batch (see
    # models/batch_invariant.py): graph replays then equal eager steps bit for bit, at a speed cost.
    batch_invariant: bool = False
    # Attention backend of full and sliding-window layers (runner_v2/attention/selector.py):
    # auto (FlashInfer on CUDA when installed, else torch), torch or flashinfer.
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        _require(bool(self.model), "model is empty: pass a preset name (e.g. smollm2-135m) or a path")
        _require(
            self.dtype in DTYPES,
            f"dtype {self.dtype!r} is not supported: use one of {', '.join(DTYPES)}",
        )
        _require(
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
            f"device {self.device!r} is not supported: use auto, cpu or cuda[:N]",
        )
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend {self.attention_backend!r} is unknown: use one of {', '.join(ATTENTION_BACKENDS)}",
        )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache: block size, pool size (explicit, a fixed space, or a memory fraction), prefix
    caching."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_fraction: float = 0.9
    #: KV space in GiB (vLLM's ``VLLM_CPU_KVCACHE_SPACE``). None: on CPU that variable, else
    #: :data:`DEFAULT_CPU_KV_CACHE_SPACE_GIB`; on CUDA ``memory_fraction`` of free memory
    #: (``kv_sizing.py``).
    kv_cache_space_gib: float | None = None
    #: None (auto): on where every KV group can serve prefix hits, else off with one line saying why;
    #: True: required (start-up refuses a model that cannot serve hits); False: off.
    enable_prefix_caching: bool | None = None
    mamba_cache_mode: str = "none"

    def __post_init__(self) -> None:
        bs = self.block_size
        _require(
            isinstance(bs, int) and bs >= 1 and bs & (bs - 1) == 0,
            f"block_size must be a power of two (1, 2, 4, ..., 16, 32, ...); got {bs!r}",
        )
        _require(
            self.num_blocks is None or self.num_blocks >= 2,
            f"num_blocks must be at least 2 (block 0 is the reserved null block); got {self.num_blocks}",
        )
        _require(
            0.0 < self.memory_fraction <= 1.0,
            f"memory_fraction must be in (0, 1]; got {self.memory_fraction}",
        )
        space = self.kv_cache_space_gib
        _require(
            space is None or (not isinstance(space, bool) and space > 0),
            f"kv_cache_space_gib must be a positive number of GiB, e.g. 4; got {space!r}",
        )
        _require(
            space is None or self.num_blocks is None,
            f"num_blocks ({self.num_blocks}) and kv_cache_space ({space} GiB) both size the KV pool: "
            "pass only one",
        )
        _require(
            self.mamba_cache_mode in MAMBA_CACHE_MODES,
            f"mamba_cache_mode {self.mamba_cache_mode!r} is unknown: use one of "
            f"{', '.join(MAMBA_CACHE_MODES)}",
        )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits: sequences and tokens per step, context length, chunking."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    #: the most prompt tokens (new prompts, chunks and recomputed ones) a step computes while it
    #: also decodes (``core/scheduler.py``), so a burst of prompts cannot stall the running decodes
    #: for a whole budget's forward; a step with nothing decoding keeps the whole budget. None or 0:
    #: no cap (the whole ``max_num_batched_tokens``; 0 is kept as None). ``warmup serve`` on CPU
    #: sets it (``engine_args.SERVING_PREFILL_WITH_DECODES_CPU``).
    max_prefill_tokens_with_decodes: int | None = None
    #: one step in flight (``core/scheduler.py``, ``engine.py``): the next step is scheduled while
    #: this one runs. None (auto): on where it helps (a CUDA device, one rank, no P/D, no Mamba
    #: state), off elsewhere; True: required (refused where unsupported); False: off.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len must be >= 1; got {self.max_model_len}",
        )
        cap = self.max_prefill_tokens_with_decodes
        _require(
            cap is None or (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0),
            f"max_prefill_tokens_with_decodes must be a token count >= 1, or 0 for no cap; got {cap!r}",
        )
        if cap == 0:
            object.__setattr__(self, "max_prefill_tokens_with_decodes", None)
        _require(
            self.max_prefill_tokens_with_decodes is None or self.enable_chunked_prefill,
            f"max_prefill_tokens_with_decodes={self.max_prefill_tokens_with_decodes} needs chunked "
            "prefill (a prompt longer than the cap would wait until nothing decodes): enable chunked "
            "prefill or leave the cap unset",
        )


class _SpeculativeJSON(BaseModel):
    """The keys of a vLLM-style speculative config object (values are checked by the dataclass)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    method: str
    num_speculative_tokens: int = 1
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4


class _KVTransferJSON(BaseModel):
    """The keys of a P/D KV transfer object in the reference engine's form."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kv_connector: str
    kv_role: str
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_buffer_device: str = "cpu"
    kv_connector_extra_config: dict[str, object] = {}


def _validated_json(model: type[BaseModel], data: dict, what: str, example: str) -> dict:
    """``data`` checked against ``model`` (keys, required keys, types), as keyword arguments for
    the dataclass; the first problem becomes one :class:`ConfigError` naming the key and the value."""
    try:
        return model.model_validate(data).model_dump(exclude_unset=True)
    except ValidationError as exc:
        known = sorted(model.model_fields)
        unknown = sorted(str(e["loc"][0]) for e in exc.errors() if e["type"] == "extra_forbidden")
        if unknown:
            raise ConfigError(f"unknown {what} keys {unknown}: known keys are {known}") from None
        missing = [str(e["loc"][0]) for e in exc.errors() if e["type"] == "missing"]
        if missing:
            names = ", ".join(f'"{m}"' for m in missing)
            raise ConfigError(f"{what} needs {names}, e.g. {example}") from None
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise ConfigError(
            f"{what} {key}: {first['msg'].lower()} (got {first.get('input')!r}); e.g. {example}"
        ) from None


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding: method, k draft tokens, optional draft model and method options."""

    method: str
    num_speculative_tokens: int = 1
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        entry = spec_method(self.method)
        k = self.num_speculative_tokens
        _require(
            isinstance(k, int) and 1 <= k <= MAX_SPECULATIVE_TOKENS,
            f"num_speculative_tokens for {self.method} must be an integer in "
            f"1..{MAX_SPECULATIVE_TOKENS}; got {k!r}",
        )
        _require(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            "ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max; got "
            f"{self.prompt_lookup_min}..{self.prompt_lookup_max}",
        )
        if entry.weights == "none":
            _require(
                self.model is None,
                f"{self.method} drafts without weights, so it takes no draft model or head "
                f"(got @{self.model}): drop the @DRAFT path",
            )

    @property
    def entry(self) -> SpecMethod:
        """The method's entry in the table of speculative methods (``spec_methods.py``)."""
        return spec_method(self.method)

    @property
    def lookahead(self) -> int:
        """KV slots the drafter writes past the scheduled tokens, from the method table."""
        return self.entry.lookahead(self.num_speculative_tokens)

    @classmethod
    def parse(cls, text: str | dict | None) -> SpeculativeConfig | None:
        """Parse ``METHOD[:K][@DRAFT_PATH]``, a vLLM-style JSON object, or ``none``."""
        if text is None:
            return None
        if isinstance(text, dict):
            return cls._from_mapping(text)
        text = text.strip()
        if text in ("", "none", "off"):
            return None
        if text.startswith("{"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative config is not valid JSON ({exc.msg}): {text!r}") from None
            if not isinstance(data, dict):
                raise ConfigError(f"speculative JSON must be an object; got {text!r}")
            return cls._from_mapping(data)
        head, _, draft = text.partition("@")
        method, colon, k_text = head.partition(":")
        k = 1
        if colon and not k_text.strip():
            # NOTE: ``eagle3:`` once meant k = 1 silently; a typo'd K must not run another setting.
            raise ConfigError(
                f"speculative spec {text!r} has ':' but no K: write the number of draft tokens, "
                f"as in {method.strip() or 'eagle3'}:3, or drop the ':' for k = 1"
            )
        if k_text:
            try:
                k = int(k_text)
            except ValueError:
                raise ConfigError(
                    f"speculative spec {text!r}: K must be an integer, as in eagle3:3 or dflash:7"
                ) from None
        return cls(method=method.strip(), num_speculative_tokens=k, model=draft or None)

    @classmethod
    def _from_mapping(cls, data: dict) -> SpeculativeConfig:
        fields = _validated_json(_SpeculativeJSON, data, "speculative config", '{"method": "eagle3", ...}')
        return cls(**fields)

    def short(self) -> str:
        """The short form ``METHOD:K[@DRAFT]``."""
        return f"{self.method}:{self.num_speculative_tokens}" + (f"@{self.model}" if self.model else "")


KV_CONNECTORS: tuple[str, ...] = ("NixlConnector",)
#: the reference engine's transfer roles -> this engine's ``kv_role``. ``kv_both`` decodes too, so its
#: drafter runs and it plans like a consumer.
KV_TRANSFER_ROLES: dict[str, str] = {
    "kv_producer": "producer",
    "kv_consumer": "consumer",
    "kv_both": "consumer",
}


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """A P/D KV transfer in the reference engine's JSON form, e.g.
    ``{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}``.

    ``engine_id`` names this instance to its peers (default: generated by the connector);
    ``kv_ip``/``kv_port`` are where its side channel listens (port 0: a free one);
    ``kv_connector_extra_config`` holds connector-specific options.
    """

    kv_connector: str
    kv_role: str
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_buffer_device: str = "cpu"
    kv_connector_extra_config: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(
            self.kv_connector in KV_CONNECTORS,
            f"kv_connector {self.kv_connector!r} is unknown: use one of {', '.join(KV_CONNECTORS)}",
        )
        _require(
            self.kv_role in KV_TRANSFER_ROLES,
            f"kv_transfer_config kv_role {self.kv_role!r} is unknown: use one of {', '.join(KV_TRANSFER_ROLES)}",
        )
        _require(0 <= self.kv_port < 65536, f"kv_port {self.kv_port} is not a TCP port (0..65535)")

    @property
    def engine_role(self) -> str:
        """This engine's ``kv_role`` (``producer`` or ``consumer``)."""
        return KV_TRANSFER_ROLES[self.kv_role]

    @classmethod
    def parse(cls, value: str | dict | KVTransferConfig | None) -> KVTransferConfig | None:
        """From a JSON object (text or dict), an instance, or None / ``none`` / ``""``."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            text = value.strip()
            if text in ("", "none"):
                return None
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"kv_transfer_config is not valid JSON ({exc.msg}): {text!r}; write e.g. "
                    '\'{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}\''
                ) from None
        _require(isinstance(value, dict), f"kv_transfer_config must be a JSON object; got {value!r}")
        value = _validated_json(
            _KVTransferJSON,
            value,
            "kv_transfer_config",
            '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}',
        )
        return cls(**value)


#: ``auto`` (the compiled kernel when it builds, else torch's), ``torch`` (never), ``kernel`` (required)
CPU_KERNEL_MODES: tuple[str, ...] = ("auto", "torch", "kernel")
CPU_ISAS: tuple[str, ...] = ("native", "avx2", "avx512", "baseline")
GREEDY_HEAD_MODES: tuple[str, ...] = ("on", "off", "portable")
FUSED_OPS_MODES: tuple[str, ...] = ("auto", "torch")
TP_COMM_MODES: tuple[str, ...] = ("auto", "shm", "gloo")
#: ``auto``: two ranks with uneven attention heads even out their work (``models/llama.py``
#: KVOffload); ``heads``: each rank projects exactly its heads
TP_BALANCE_MODES: tuple[str, ...] = ("auto", "heads")
#: older spellings of the greedy-head switch (its environment variable took 1 and 0)
_GREEDY_HEAD_ALIASES = {"1": "on", "0": "off"}


#: each field of :class:`KernelConfig`: its values and the environment variable that defaults it
KERNEL_CHOICES: dict[str, tuple[tuple[str, ...], str]] = {
    "cpu_gemm": (CPU_KERNEL_MODES, "WARMCAP_CPU_GEMM"),
    "cpu_layer_ops": (CPU_KERNEL_MODES, "WARMCAP_CPU_LAYER_OPS"),
    "cpu_attention": (CPU_KERNEL_MODES, "WARMCAP_CPU_ATTENTION"),
    "cpu_isa": (CPU_ISAS, "WARMCAP_CPU_ISA"),
    "exact_greedy_head": (GREEDY_HEAD_MODES, "WARMCAP_EXACT_GREEDY_HEAD"),
    "fused_ops": (FUSED_OPS_MODES, "WARMCAP_FUSED_OPS"),
    "tp_comm": (TP_COMM_MODES, "WARMCAP_TP_COMM"),
    "tp_balance": (TP_BALANCE_MODES, "WARMCAP_TP_BALANCE"),
}


def kernel_default(name: str) -> str:
    """The default of :class:`KernelConfig`'s field ``name``: its environment variable, else the
    first of its values; ConfigError naming the variable when it holds anything else. Code handed
    no config reads one setting through here, never by building a whole :class:`KernelConfig`."""
    variable = KERNEL_CHOICES[name][1]
    return _kernel_value(name, env.read(variable).lower(), env.source(variable))


def _kernel_value(name: str, value: object, origin: str = "") -> str:
    """``value`` of :class:`KernelConfig`'s field ``name`` as the record keeps it (the greedy
    head's "1"/"0" as on/off); ConfigError, saying where it came from (``origin``), when it is not
    one of the field's values."""
    allowed = KERNEL_CHOICES[name][0]
    if isinstance(value, str) and name == "exact_greedy_head":
        value = _GREEDY_HEAD_ALIASES.get(value, value)
    if value not in allowed:
        raise ConfigError(f"{name} {value!r}{origin} is not one of {', '.join(allowed)}: pick one")
    return value  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Which kernels a forward runs: every switch that can change a result without changing the
    model. Each field defaults to its environment variable (``warmcap/env.py``), and from there to
    ``auto``/``native``/``on``; ``LLM(...)`` and every command (``--cpu-gemm`` ...) set it. The
    start-up verdict cache keys on this record (``graphs/proof/startup_cache.py``), so a verdict is
    never reused for kernels it was not checked with."""

    #: the compiled CPU GEMM (``kernels/cpu/gemm.c``) for packed linears, else oneDNN's
    cpu_gemm: str = field(default_factory=partial(kernel_default, "cpu_gemm"))
    #: the compiled CPU layer ops (RMSNorm, SiLU-mul, RoPE), else torch's
    cpu_layer_ops: str = field(default_factory=partial(kernel_default, "cpu_layer_ops"))
    #: the compiled CPU paged attention, else gather + SDPA
    cpu_attention: str = field(default_factory=partial(kernel_default, "cpu_attention"))
    #: the instruction set the CPU kernels are compiled for (one per process: the first engine's)
    cpu_isa: str = field(default_factory=partial(kernel_default, "cpu_isa"))
    #: the screened exact greedy head on CPU (``models/greedy_head.py``): on, off (full logits every
    #: step) or portable (float32-held screen, no oneDNN bf16)
    exact_greedy_head: str = field(default_factory=partial(kernel_default, "exact_greedy_head"))
    #: the fused Triton layer ops on CUDA (``models/fused_ops.py``): auto or torch
    fused_ops: str = field(default_factory=partial(kernel_default, "fused_ops"))
    #: collectives between the tensor-parallel ranks of one machine: auto (shared memory on CPU),
    #: shm or gloo (``distributed/shm_comm.py``); a sum's order, so its rounding, depends on it
    tp_comm: str = field(default_factory=partial(kernel_default, "tp_comm"))
    #: two tensor-parallel ranks whose attention heads split unevenly: auto (the busier rank's K/V
    #: projected by the other, ``models/llama.py`` KVOffload) or heads (each rank its own heads);
    #: the same bits either way
    tp_balance: str = field(default_factory=partial(kernel_default, "tp_balance"))

    def __post_init__(self) -> None:
        for name in KERNEL_CHOICES:
            object.__setattr__(self, name, _kernel_value(name, getattr(self, name)))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine, the scheduler, the runner and the warmup planner read."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    #: which kernels a forward runs (every switch that can change a result)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    speculative: SpeculativeConfig | None = None
    #: P/D role; filled from ``kv_transfer`` when that is given and this is left at ``none``
    kv_role: str = "none"
    kv_transfer: KVTransferConfig | None = None
    #: ranks the model is sharded over (``warmcap.distributed``); 1: one device, no workers
    tensor_parallel_size: int = 1
    #: model threads of each rank on CPU (None: torch's count with one rank, else the rank's share
    #: of the cores); see ``kernels/cpu/threads.py``
    cpu_threads: int | None = None
    #: where those threads run: auto (pinned to the rank's share of the cores), none, or CPU lists
    cpu_threads_bind: str = "auto"

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        ct = self.cpu_threads
        _require(
            ct is None or (isinstance(ct, int) and not isinstance(ct, bool) and ct >= 1),
            f"cpu_threads must be an integer >= 1, got {ct!r}: or leave it unset for the default",
        )
        _require(
            isinstance(self.cpu_threads_bind, str) and _CPU_BIND.fullmatch(self.cpu_threads_bind) is not None,
            f"cpu_threads_bind {self.cpu_threads_bind!r} is not auto, none or a CPU list such as 0-3 or 0,2 "
            "(one per tensor-parallel rank separated by |, e.g. 0|1)",
        )
        _require(
            isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1,
            f"tensor_parallel_size must be an integer >= 1, got {tp!r}: use 1 for one device",
        )
        _require(
            self.kv_role in KV_ROLES,
            f"kv_role {self.kv_role!r} is unknown: use one of {', '.join(KV_ROLES)}",
        )
        if self.kv_transfer is not None:
            role = self.kv_transfer.engine_role
            _require(
                self.kv_role in ("none", role),
                f"kv_role {self.kv_role!r} contradicts kv_transfer_config kv_role "
                f"{self.kv_transfer.kv_role!r} (which means {role!r}): give only one of them",
            )
            # NOTE: one role for every reader (scheduler, planner, drafter factory): the transfer's.
            object.__setattr__(self, "kv_role", role)
        _require(
            tp == 1 or self.kv_role == "none",
            f"kv_role {self.kv_role!r} (P/D KV transfer) is not supported with tensor_parallel_size = "
            f"{tp}: the connector would see only rank 0's KV heads; use tensor_parallel_size 1",
        )
        if self.scheduler.async_scheduling:
            _require(
                tp == 1,
                f"async_scheduling is not supported with tensor_parallel_size = {tp} yet: the worker "
                "ranks run each step synchronously; drop --async-scheduling or use tensor_parallel_size 1",
            )
            _require(
                self.kv_role == "none",
                f"async_scheduling is not supported with kv_role {self.kv_role!r} (P/D KV transfer) yet: "
                "KV transfers are reported by the step that ran them; drop --async-scheduling",
            )

    @property
    def num_speculative_tokens(self) -> int:
        """k: draft tokens per step (0 without speculation or for a prefill producer)."""
        if self.speculative is None or self.kv_role == "producer":
            return 0
        return self.speculative.num_speculative_tokens

    @property
    def runs_drafter(self) -> bool:
        """Whether this engine builds its drafter. A P/D producer keeps a model-based one (its
        prompt pass writes the drafter's prompt KV, which the consumer reads) but proposes nothing
        (``num_speculative_tokens`` is 0); ngram has no KV, so a producer has none."""
        if self.speculative is None:
            return False
        return self.kv_role != "producer" or self.speculative.entry.extra_lookahead is not None

    @property
    def num_lookahead_tokens(self) -> int:
        """L: slots reserved past the scheduled tokens for the drafter's KV writes."""
        if self.speculative is None or self.kv_role == "producer":
            return 0
        return self.speculative.lookahead

    @property
    def uniform_decode_query_len(self) -> int:
        """Query tokens of a decode step verifying k drafts (1 + k for every method; not derived
        from the lookahead); 1 without speculation or for a prefill producer."""
        if self.speculative is None:
            return 1
        return self.speculative.entry.uniform_decode_query_len(self.num_speculative_tokens)

    @property
    def max_model_len(self) -> int:
        """The context limit; the engine fills it from the model when the user gave none."""
        if self.scheduler.max_model_len is None:
            raise ConfigError("max_model_len is unresolved: set --max-model-len or load the model first")
        return self.scheduler.max_model_len

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        """A copy whose scheduler has ``max_model_len`` filled in."""
        return replace(self, scheduler=replace(self.scheduler, max_model_len=max_model_len))

    def validate_against(self, *, model_max_len: int) -> None:
        """Cross-checks that need the model: context length fits what the model supports."""
        mml = self.scheduler.max_model_len
        _require(
            mml is None or mml <= model_max_len,
            f"max_model_len {mml} exceeds the model's limit {model_max_len}: lower --max-model-len",
        )


#: which target graphs a plan makes (``graphs/capture/planning.py:plan_target``): ``all`` (uniform
#: decode for every request count, mixed at the capture sizes), ``sizes`` (both at the capture sizes
#: only, a decode step padded to the next, as vLLM pads), ``decode`` (uniform decode at the capture
#: sizes, mixed steps eager)
GRAPH_SHAPES: tuple[str, ...] = ("all", "sizes", "decode")
GRAPH_SHAPES_HELP = (
    "all (a decode graph per request count, mixed graphs at the capture sizes), sizes (decode and "
    "mixed graphs at the capture sizes only, a decode step padded to the next) or decode (decode "
    "graphs at the capture sizes, mixed steps eager)"
)


def check_graph_shapes(mode: str) -> None:
    """ConfigError naming ``mode`` unless it is one of :data:`GRAPH_SHAPES`."""
    _require(
        mode in GRAPH_SHAPES,
        f"graph_shapes {mode!r} is not one of {', '.join(GRAPH_SHAPES)}: {GRAPH_SHAPES_HELP}",
    )


@dataclass(frozen=True, slots=True)
class StartupOptions:
    """How start-up proves an engine before its first request: one record with one set of defaults,
    taken by ``LLM(...)``, ``run_startup`` (``warmup run``), ``warmup serve`` and ``warmup generate``
    and the device checks alike. None of it changes a result; it changes what is checked and shown.
    """

    #: graph backend: cuda, static or compile (None: cuda on a GPU, else static)
    backend: str | None = None
    #: token counts of the graphs to capture (None: the planner's ladder, ``graphs/capture/sizes.py``)
    capture_sizes: tuple[int, ...] | None = None
    #: audit every KV write warmup makes (off: the report says "audit off")
    audit: bool = True
    #: audit the KV writes of every serving step too (a stray write fails that step's requests)
    audit_serving: bool = False
    #: reuse graph verdicts of an identical earlier start, verifying one graph per phase afresh
    #: (``graphs/proof/startup_cache.py``; the cache is ``$WARMCAP_STARTUP_CACHE``)
    startup_cache: bool = True
    #: ``static`` graphs on CPU replay a recording of their forward's kernel calls where they can
    #: (``graphs/capture/cpu_program.py``); off: every replay runs the forward
    record_cpu_graphs: bool = True
    #: which target graphs: ``all`` (a uniform-decode graph for every request count up to
    #: ``max_num_seqs``, no decode step padded; mixed graphs at the capture sizes), ``sizes`` (both
    #: at the capture sizes, a decode step padded to the next, as vLLM pads) or ``decode`` (decode
    #: graphs at the capture sizes, mixed steps eager). None: ``all``, except that ``warmup serve``
    #: on CPU takes ``decode`` (``cli.py:serving_graphs``)
    graph_shapes: str | None = None

    def __post_init__(self) -> None:
        _require(
            self.backend in (None, "cuda", "static", "compile"),
            f"unknown graph backend {self.backend!r}: use one of cuda, static, compile (or leave it unset)",
        )
        if self.capture_sizes is not None:
            sizes = tuple(self.capture_sizes)
            _require(
                len(sizes) > 0
                and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes),
                f"capture_sizes {self.capture_sizes!r} must be token counts >= 1, e.g. (1, 2, 4, 8)",
            )
            object.__setattr__(self, "capture_sizes", tuple(sorted(set(sizes))))
        if self.graph_shapes is not None:  # None: the default (``all``, or serve's on CPU)
            check_graph_shapes(self.graph_shapes)
        for name in ("audit", "audit_serving", "startup_cache", "record_cpu_graphs"):
            _require(
                isinstance(getattr(self, name), bool),
                f"{name} must be True or False, got {getattr(self, name)!r}",
            )

    @classmethod
    def resolve(cls, startup: StartupOptions | None, options: dict[str, object]) -> StartupOptions:
        """``startup`` or the options named flat (``LLM(audit=False)``), never both."""
        unknown = sorted(set(options) - set(STARTUP_OPTION_NAMES))
        _require(
            not unknown, f"unknown start-up option(s) {unknown}: valid are {', '.join(STARTUP_OPTION_NAMES)}"
        )
        if startup is None:
            return cls(**options)  # type: ignore[arg-type]
        _require(
            not options,
            f"pass start-up options either as startup=StartupOptions(...) or by name, not both (got {sorted(options)})",
        )
        return startup


#: the start-up options a caller may name (``LLM(audit=False)``): ``StartupOptions``' fields
STARTUP_OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(StartupOptions))
