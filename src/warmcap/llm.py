"""``LLM``: offline generation with vLLM's keyword arguments, mapped onto an :class:`EngineConfig`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from warmcap.config import STARTUP_OPTION_NAMES, StartupOptions
from warmcap.engine import LLMEngine
from warmcap.engine_args import ENGINE_KWARGS, auto_dtype, build_config
from warmcap.errors import ConfigError
from warmcap.outputs import RequestOutput
from warmcap.prompts import PromptType, chat_prompt_ids, split_prompt
from warmcap.sampling_params import SamplingParams

#: ``LLM``'s keyword arguments besides the model and ``startup``: every option of
#: ``engine_args.ENGINE_ARGS`` and every start-up option (:class:`~warmcap.config.StartupOptions`).
LLM_KWARGS: tuple[str, ...] = (*ENGINE_KWARGS, *STARTUP_OPTION_NAMES)


class LLM:
    """Offline generation: ``LLM("smollm2-135m").generate(["Hello"], SamplingParams(max_tokens=8))``.

    Keyword arguments are vLLM's where warmcap has the setting (``gpu_memory_utilization``,
    ``dtype="auto"``, ``speculative_config``, ``tensor_parallel_size``, ...); see :data:`LLM_KWARGS` (the table in ``engine_args.py``).
    With ``tensor_parallel_size=N`` the model is sharded over this process (rank 0) and N-1
    worker processes; :meth:`shutdown` stops them.
    """

    def __init__(
        self, model: str = "smollm2-135m", *, startup: StartupOptions | None = None, **kwargs: Any
    ) -> None:
        """Start-up options come as ``startup=StartupOptions(...)`` or by name (``audit=False`` runs
        warmup without its KV-write audit, ``audit_serving=True`` audits every step's writes,
        ``backend``, ``capture_sizes``, ``startup_cache``), with the defaults of
        :class:`~warmcap.config.StartupOptions`, the same as ``warmup run`` and ``warmup serve``.

        Raises :class:`~warmcap.audit.kv_writes.AuditViolationError` when the start-up audit finds a
        stray KV write: an engine whose cache may be corrupted is never handed out.
        """
        named = {k: kwargs.pop(k) for k in STARTUP_OPTION_NAMES if k in kwargs}
        options = StartupOptions.resolve(startup, named)
        self.engine = LLMEngine(build_config(model, **kwargs), startup=options)

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
        return chat_prompt_ids(tok, messages)


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
