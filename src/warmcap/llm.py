"""``LLM``: offline generation with vLLM's keyword arguments, mapped onto an :class:`EngineConfig`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any

from warmcap.config import (
    DTYPES,
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from warmcap.engine import DEFAULT_STARTUP_HOOKS, LLMEngine, resolve_device
from warmcap.errors import ConfigError
from warmcap.models.presets import resolve_model_path
from warmcap.outputs import RequestOutput
from warmcap.prompts import PromptType, split_prompt
from warmcap.sampling_params import SamplingParams
from warmcap.warmup.hook import warmup_hook

_KWARG_TARGETS: dict[str, tuple[str, str]] = {
    "dtype": ("model", "dtype"),
    "device": ("model", "device"),
    "seed": ("model", "seed"),
    "enforce_eager": ("model", "enforce_eager"),
    "batch_invariant": ("model", "batch_invariant"),
    "attention_backend": ("model", "attention_backend"),
    "block_size": ("cache", "block_size"),
    "num_blocks": ("cache", "num_blocks"),
    "memory_fraction": ("cache", "memory_fraction"),
    # vLLM's name for the share of device memory the engine may take (here: the KV pool's share).
    "gpu_memory_utilization": ("cache", "memory_fraction"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "mamba_cache_mode": ("cache", "mamba_cache_mode"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "max_model_len": ("scheduler", "max_model_len"),
    "enable_chunked_prefill": ("scheduler", "enable_chunked_prefill"),
}
LLM_KWARGS: tuple[str, ...] = (
    *_KWARG_TARGETS,
    "speculative_config",
    "kv_role",
    "kv_transfer_config",
    "tensor_parallel_size",
)


def build_config(model: str, **kwargs: Any) -> EngineConfig:
    """An :class:`EngineConfig` from ``LLM``'s flat keyword arguments.

    ``dtype="auto"`` is resolved here: see :func:`auto_dtype`.
    """
    unknown = sorted(set(kwargs) - set(LLM_KWARGS))
    if unknown:
        raise ConfigError(f"unknown LLM argument(s) {unknown}; valid: {', '.join(sorted(LLM_KWARGS))}")
    if "memory_fraction" in kwargs and "gpu_memory_utilization" in kwargs:
        raise ConfigError(
            "memory_fraction and gpu_memory_utilization name the same setting: pass only one "
            f"(got {kwargs['memory_fraction']} and {kwargs['gpu_memory_utilization']})"
        )
    if kwargs.get("dtype") == "auto":
        kwargs["dtype"] = auto_dtype(model, kwargs.get("device", "auto"))
    parts: dict[str, dict[str, Any]] = {"model": {"model": model}, "cache": {}, "scheduler": {}}
    for name, value in kwargs.items():
        if name in _KWARG_TARGETS:
            part, attr = _KWARG_TARGETS[name]
            parts[part][attr] = value
    try:
        cache = CacheConfig(**parts["cache"])
    except ConfigError as exc:
        if "gpu_memory_utilization" not in kwargs:
            raise
        # The user passed vLLM's name: the message names it, not warmcap's field it maps to.
        raise ConfigError(str(exc).replace("memory_fraction", "gpu_memory_utilization")) from None
    return EngineConfig(
        model=ModelConfig(**parts["model"]),
        cache=cache,
        scheduler=SchedulerConfig(**parts["scheduler"]),
        speculative=SpeculativeConfig.parse(kwargs.get("speculative_config")),
        kv_role=kwargs.get("kv_role", "none"),
        kv_transfer=KVTransferConfig.parse(kwargs.get("kv_transfer_config")),
        tensor_parallel_size=kwargs.get("tensor_parallel_size", 1),
    )


def auto_dtype(model: str, device: str = "auto") -> str:
    """``dtype="auto"``: the checkpoint's own dtype (``torch_dtype`` in its config.json, float32 when
    absent) on CUDA, and float32 on CPU.

    NOTE: vLLM's auto runs float32 checkpoints in float16; warmcap keeps float32, and on CPU (its
    reference path, where parity with ``transformers`` is tested) it always computes in float32.
    """
    if resolve_device(device).type != "cuda":
        return "float32"
    from warmcap.models.loader import load_hf_config

    hf_config = load_hf_config(resolve_model_path(model))
    named = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(named).removeprefix("torch.") if named is not None else "float32"
    return name if name in DTYPES else "float32"


class LLM:
    """Offline generation: ``LLM("smollm2-135m").generate(["Hello"], SamplingParams(max_tokens=8))``.

    Keyword arguments are vLLM's where warmcap has the setting (``gpu_memory_utilization``,
    ``dtype="auto"``, ``speculative_config``, ``tensor_parallel_size``, ...); see :data:`LLM_KWARGS`.
    With ``tensor_parallel_size=N`` the model is sharded over this process (rank 0) and N-1
    worker processes; :meth:`shutdown` stops them.
    """

    def __init__(
        self, model: str = "smollm2-135m", *, audit: bool = True, audit_serving: bool = False, **kwargs: Any
    ) -> None:
        """``audit=False`` runs warmup without its KV-write audit (on by default on every device);
        ``audit_serving=True`` audits the KV writes of every step (see :class:`LLMEngine`).

        Raises :class:`~warmcap.warmup.audit.AuditViolationError` when the start-up audit finds a
        stray KV write: an engine whose cache may be corrupted is never handed out.
        """
        hooks = None
        if not audit:
            hooks = [partial(h, audit=False) if h is warmup_hook else h for h in DEFAULT_STARTUP_HOOKS]
        self.engine = LLMEngine(
            build_config(model, **kwargs), startup_hooks=hooks, audit_serving=audit_serving
        )

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (``tensor_parallel_size > 1``); idempotent.
        Also run when the ``LLM`` is garbage-collected and at interpreter exit."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    def __del__(self) -> None:
        self.shutdown()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (None when the model folder has none), as vLLM's ``LLM`` gives it."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        use_chat_template: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt; one :class:`RequestOutput` per prompt, in prompt order.

        A prompt is a text, a list of token ids, or a dict with ``prompt`` or ``prompt_token_ids``;
        a single prompt may be passed bare. ``use_tqdm`` shows a progress bar on a terminal.
        """
        items = _prompt_list(prompts)
        if use_chat_template:
            items = [self._chat_prompt([{"role": "user", "content": _chat_text(p)}]) for p in items]
        return self.engine.generate(items, _per_prompt(sampling_params, len(items)), use_tqdm=use_tqdm)

    def chat(
        self, messages: Sequence[dict[str, str]], sampling_params: SamplingParams | None = None
    ) -> RequestOutput:
        """Answer one conversation (``[{"role": ..., "content": ...}, ...]``) via the chat template."""
        return self.engine.generate([self._chat_prompt(messages)], [sampling_params or SamplingParams()])[0]

    def generate_stream(
        self, prompt: str, sampling_params: SamplingParams | None = None, *, use_chat_template: bool = False
    ) -> Iterator[str]:
        """Yield text deltas of one prompt as they are generated."""
        item: str | list[int] = (
            self._chat_prompt([{"role": "user", "content": prompt}]) if use_chat_template else prompt
        )
        return self.engine.stream(item, sampling_params)

    def _chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ConfigError(
                f"{self.engine.model_path} has no chat template: call generate() with plain prompts"
            )
        # The template writes BOS itself when the model wants one; tokenizing it adds no second one.
        ids = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """A bare prompt (text, dict, or a flat list of token ids, as vLLM reads one) as a list of one."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]
    return items


def _chat_text(prompt: PromptType) -> str:
    text, _ = split_prompt(prompt)
    if not isinstance(prompt, (str, Mapping)) or text is None:
        raise ConfigError("use_chat_template needs text prompts; token id prompts are already templated")
    return text


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if len(params) != n:
        raise ConfigError(f"got {len(params)} sampling params for {n} prompts: pass one, or one per prompt")
    return list(params)


__all__ = ["LLM", "LLM_KWARGS", "auto_dtype", "build_config"]
