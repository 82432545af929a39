"""The engine loop and the user-facing ``LLM``.

Start-up: resolve the model -> load weights -> fill ``max_model_len`` -> KV groups -> size the pool
-> KV cache manager, scheduler, runner -> start-up hooks (warmup, graph capture) -> ready.
Each ``step``: ``schedule`` -> ``execute_model`` -> ``update_from_output`` -> outputs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.core.kv_cache_manager import KVCacheManager
from warmcap.core.request import Request
from warmcap.core.scheduler import Scheduler
from warmcap.drafters import build_drafter
from warmcap.errors import ConfigError
from warmcap.graphs.hook import graph_capture_hook
from warmcap.kv_layout import build_kv_groups
from warmcap.kv_sizing import num_kv_blocks
from warmcap.metrics import SpecDecodeMetrics
from warmcap.runner_v2.model_runner import TORCH_DTYPES, ModelRunner
from warmcap.sampling_params import SamplingParams
from warmcap.startup_hooks import StartupContext, StartupHook, hook_name
from warmcap.warmup.hook import warmup_hook

if TYPE_CHECKING:
    from warmcap.graphs.startup import GraphStartup
    from warmcap.warmup.run import WarmupResult

#: Hooks every new engine runs after it is built, in order (warmup and graph capture register here).
DEFAULT_STARTUP_HOOKS: list[StartupHook] = [warmup_hook, graph_capture_hook]


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (``time.monotonic``) and counters of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    """A request's progress so far; ``finished`` once ``finish_reason`` is set."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    finished: bool = False
    new_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Tracked:
    request: Request
    prompt: str | None
    metrics: RequestMetrics


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_model_path(name: str) -> Path:
    """A local HF directory as given, else a preset name resolved by ``warmcap.models.presets``."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    from warmcap.models.presets import resolve_model

    return Path(resolve_model(name))


class LLMEngine:
    """Continuous batching over one model: add requests, call :meth:`step` until done.

    ``startup_hooks`` (default: a copy of :data:`DEFAULT_STARTUP_HOOKS`) run in order once the
    scheduler and runner exist, before the first request; each gets a
    :class:`~warmcap.startup_hooks.StartupContext` and its result is kept in ``startup_results``
    under its name (``warmup``, ``graph_capture``).
    """

    def __init__(self, config: EngineConfig, *, startup_hooks: Sequence[StartupHook] | None = None) -> None:
        from warmcap.models.loader import load_hf_config, load_model, load_tokenizer
        from warmcap.runner_v2.attention.selector import select_backend

        t_load = time.perf_counter()
        self.device = resolve_device(config.model.device)
        self.model_path = resolve_model_path(config.model.model)
        hf_config = load_hf_config(self.model_path)
        model_max_len = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or None
        if model_max_len is not None:
            config.validate_against(model_max_len=model_max_len)
        if config.scheduler.max_model_len is None:
            if model_max_len is None:
                raise ConfigError(
                    f"{self.model_path} does not state max_position_embeddings: set max_model_len"
                )
            config = config.with_max_model_len(model_max_len)
        self.config = config
        torch.manual_seed(config.model.seed)
        self.model = load_model(
            self.model_path,
            dtype=TORCH_DTYPES[config.model.dtype],
            device=self.device,
            batch_invariant=config.model.batch_invariant,
        )
        self.tokenizer = _try_tokenizer(load_tokenizer, self.model_path)
        self.drafter = build_drafter(config, self.model)
        t_kv = time.perf_counter()
        self.kv_groups = build_kv_groups(self.model, config, self.drafter)
        self.num_blocks = num_kv_blocks(config, self.kv_groups, self.device)
        self.kv_cache_manager = KVCacheManager(
            self.kv_groups,
            self.num_blocks,
            max_model_len=config.max_model_len,
            enable_caching=config.cache.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            config, self.kv_cache_manager, eos_token_id=_eos_id(self.tokenizer, hf_config)
        )
        self.runner = ModelRunner(
            config,
            self.model,
            self.kv_groups,
            self.num_blocks,
            device=self.device,
            attn_backend=select_backend(self.device),
            drafter=self.drafter,
        )
        self.spec_metrics = SpecDecodeMetrics()
        self._requests: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        #: seconds per start-up phase: load (weights, tokenizer, drafter), kv_sizing (groups, pool,
        #: caches, runner buffers), then one entry per hook
        self.startup_timings: dict[str, float] = {
            "load": t_kv - t_load,
            "kv_sizing": time.perf_counter() - t_kv,
        }
        self.startup_hooks: list[StartupHook] = list(
            DEFAULT_STARTUP_HOOKS if startup_hooks is None else startup_hooks
        )
        #: each hook's result by :func:`~warmcap.startup_hooks.hook_name`
        self.startup_results: dict[str, Any] = {}
        #: what each start-up hook is given (hooks may also be run again on it later)
        self.startup_context = StartupContext(
            config=config,
            device=self.device,
            kv_groups=self.kv_groups,
            num_blocks=self.num_blocks,
            kv_cache_manager=self.kv_cache_manager,
            runner=self.runner,
        )
        for hook in self.startup_hooks:
            t_hook = time.perf_counter()
            name = hook_name(hook)
            self.startup_results[name] = hook(self.startup_context)
            self.startup_timings[name] = time.perf_counter() - t_hook

    @property
    def warmup_result(self) -> WarmupResult | None:
        """What the warmup hook did (None: it did not run)."""
        return self.startup_results.get("warmup")

    @property
    def graph_startup(self) -> GraphStartup | None:
        """The captured graphs (None: the graph hook did not run, or ``enforce_eager``)."""
        return self.startup_results.get("graph_capture")

    # ---- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a prompt (text or token ids); returns its request id."""
        params = sampling_params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        req_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        now = time.monotonic()
        request = Request(req_id, token_ids, params, arrival_time=now)
        self.scheduler.add_request(request)
        self._requests[req_id] = _Tracked(
            request, text, RequestMetrics(now, num_prompt_tokens=len(token_ids))
        )
        return req_id

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False when it is unknown or already finished."""
        self._requests.pop(request_id, None)
        return self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns an output for every request that gained tokens."""
        sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute_model(sched_out)
        results = self.scheduler.update_from_output(sched_out, runner_out)
        now = time.monotonic()
        outputs = []
        for res in results:
            tracked = self._requests.get(res.req_id)
            if tracked is None:
                continue
            m = tracked.metrics
            if m.first_token_time is None and res.new_token_ids:
                m.first_token_time = now
            self.spec_metrics.observe(res.num_draft_tokens, res.num_accepted_tokens)
            m.num_draft_tokens += res.num_draft_tokens
            m.num_accepted_tokens += res.num_accepted_tokens
            if res.finished:
                m.finished_time = now
                del self._requests[res.req_id]
            outputs.append(self._output(tracked, res.new_token_ids, res.finish_reason, res.finished))
        return outputs

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in prompt order."""
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids) and self.has_unfinished():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request as it grows (deltas), running the engine meanwhile."""
        req_id = self.add_request(prompt, params)
        shown = ""
        finished = False
        while not finished and self.has_unfinished():
            for out in self.step():
                if out.request_id != req_id:
                    continue
                finished = out.finished
                # A token may complete a multi-byte character only with the next one: hold back "�".
                text = out.text if finished else out.text.rstrip("\ufffd")
                if len(text) > len(shown) and text.startswith(shown):
                    yield text[len(shown) :]
                    shown = text

    # ---- text ----------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ConfigError(f"{self.model_path} has no tokenizer: pass prompt token ids instead of text")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _output(self, tracked: _Tracked, new: list[int], reason: str | None, finished: bool) -> RequestOutput:
        req = tracked.request
        tokens = list(req.output_token_ids)
        return RequestOutput(
            request_id=req.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=req.prompt_token_ids,
            text=self.decode(tokens),
            token_ids=tokens,
            finish_reason=reason,
            metrics=tracked.metrics,
            finished=finished,
            new_token_ids=list(new),
        )


def _try_tokenizer(load: Callable[[Path], Any], path: Path) -> Any:
    has_files = any(
        (path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    return load(path) if has_files else None


def _eos_id(tokenizer: Any, hf_config: Any) -> int | None:
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos


# ---- LLM: flat keyword arguments -> EngineConfig ------------------------------------------------

_KWARG_TARGETS: dict[str, tuple[str, str]] = {
    "dtype": ("model", "dtype"),
    "device": ("model", "device"),
    "seed": ("model", "seed"),
    "enforce_eager": ("model", "enforce_eager"),
    "batch_invariant": ("model", "batch_invariant"),
    "block_size": ("cache", "block_size"),
    "num_blocks": ("cache", "num_blocks"),
    "memory_fraction": ("cache", "memory_fraction"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "mamba_cache_mode": ("cache", "mamba_cache_mode"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "max_model_len": ("scheduler", "max_model_len"),
    "enable_chunked_prefill": ("scheduler", "enable_chunked_prefill"),
}
LLM_KWARGS: tuple[str, ...] = (*_KWARG_TARGETS, "speculative_config", "kv_role")


def build_config(model: str, **kwargs: Any) -> EngineConfig:
    """An :class:`EngineConfig` from ``LLM``'s flat keyword arguments."""
    unknown = sorted(set(kwargs) - set(LLM_KWARGS))
    if unknown:
        raise ConfigError(f"unknown LLM argument(s) {unknown}; valid: {', '.join(sorted(LLM_KWARGS))}")
    parts: dict[str, dict[str, Any]] = {"model": {"model": model}, "cache": {}, "scheduler": {}}
    for name, value in kwargs.items():
        if name in _KWARG_TARGETS:
            part, attr = _KWARG_TARGETS[name]
            parts[part][attr] = value
    return EngineConfig(
        model=ModelConfig(**parts["model"]),
        cache=CacheConfig(**parts["cache"]),
        scheduler=SchedulerConfig(**parts["scheduler"]),
        speculative=SpeculativeConfig.parse(kwargs.get("speculative_config")),
        kv_role=kwargs.get("kv_role", "none"),
    )


class LLM:
    """Offline generation: ``LLM("smollm2-135m").generate(["Hello"], SamplingParams(max_tokens=8))``."""

    def __init__(self, model: str = "smollm2-135m", **kwargs: Any) -> None:
        self.engine = LLMEngine(build_config(model, **kwargs))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_chat_template: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in prompt order."""
        items = [prompts] if isinstance(prompts, str) else list(prompts)
        if use_chat_template:
            items = [self._chat_prompt([{"role": "user", "content": p}]) for p in items]
        return self.engine.generate(items, _per_prompt(sampling_params, len(items)))

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
        ids = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if len(params) != n:
        raise ConfigError(f"got {len(params)} sampling params for {n} prompts: pass one, or one per prompt")
    return list(params)


__all__ = [
    "DEFAULT_STARTUP_HOOKS",
    "LLM",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "build_config",
]
