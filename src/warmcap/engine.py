"""The engine loop: requests in, steps, outputs out (the user-facing ``LLM`` is in ``warmcap.llm``).

Start-up: resolve the model -> load weights -> fill ``max_model_len`` -> KV groups -> size the pool
-> KV cache manager, scheduler, runner -> start-up hooks (warmup, graph capture) -> ready.
Each ``step``: ``schedule`` -> ``execute_model`` -> ``update_from_output`` -> outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from warmcap.assembly import assemble, finish_config, resolve_async_scheduling, resolve_device
from warmcap.audit.serving import ServingAudit
from warmcap.config import EngineConfig, StartupOptions
from warmcap.contracts.parallel import replicated
from warmcap.core.kv_cache_manager import KVCacheManager
from warmcap.core.outputs import SchedulerOutput
from warmcap.core.request import Request
from warmcap.core.scheduler import Scheduler
from warmcap.detokenizer import TextDecoder
from warmcap.distributed.executor import TPExecutor
from warmcap.drafters import build_drafter
from warmcap.errors import ConfigError, NonFiniteLogitsError
from warmcap.graphs.hook import graph_capture_hook
from warmcap.kernels.cpu.build import use_isa
from warmcap.kernels.cpu.threads import start_threads
from warmcap.kv_sizing import free_memory_bytes
from warmcap.kv_transfer.factory import build_kv_connector
from warmcap.kv_transfer.params import check_transfer_params
from warmcap.metrics import SpecDecodeMetrics
from warmcap.models.decoder import check_tensor_parallel
from warmcap.models.dtypes import TORCH_DTYPES
from warmcap.models.presets import resolve_model_path
from warmcap.models.registry import model_class
from warmcap.output_processor import TrackedRequest, apply_stop_strings, gather_samples, token_logprobs
from warmcap.outputs import CompletionOutput, RequestMetrics, RequestOutput
from warmcap.progress import progress_bar
from warmcap.prompts import PromptType, check_token_ids, encode_text, split_prompt
from warmcap.runner_v2.model_runner import ModelRunner
from warmcap.runner_v2.step_result import StepResult
from warmcap.sampling_params import RequestOutputKind, SamplingParams
from warmcap.startup_hooks import (
    StartupContext,
    StartupEvent,
    StartupHook,
    StartupObserver,
    current_observer,
    hook_name,
    notify,
)
from warmcap.warmup.hook import warmup_hook

if TYPE_CHECKING:
    from warmcap.graphs.startup import GraphStartup
    from warmcap.warmup.run import WarmupResult

#: Hooks every new engine runs after it is built, in order (warmup and graph capture register here).
DEFAULT_STARTUP_HOOKS: list[StartupHook] = [warmup_hook, graph_capture_hook]


def startup_hooks_for(startup: StartupOptions, *, strict: bool = True) -> list[StartupHook]:
    """:data:`DEFAULT_STARTUP_HOOKS` given ``startup``'s options. ``strict``: a warmup audit
    violation raises (``LLM``); False leaves judging it to the caller's report (``warmup run``,
    ``warmup serve``)."""
    sizes = list(startup.capture_sizes) if startup.capture_sizes is not None else None
    return [
        partial(warmup_hook, audit=startup.audit, strict=strict),
        partial(
            graph_capture_hook,
            backend=startup.backend,
            capture_sizes=sizes,
            startup_cache=startup.startup_cache,
            record_cpu_graphs=startup.record_cpu_graphs,
            graph_shapes=startup.graph_shapes or "all",
        ),
    ]


# The engine's per-request record (the name ``LLMEngine.__init__`` annotates ``_requests`` with).
_Tracked = TrackedRequest


class LLMEngine:
    """Continuous batching over one model: add requests, call :meth:`step` until done.

    ``startup`` (default: :class:`~warmcap.config.StartupOptions`' defaults) sets how start-up
    proves the engine: the default hooks (:func:`startup_hooks_for`) and the serving audit.
    ``startup_hooks`` replaces those hooks (tests and tools with hooks of their own); they run in
    order once the scheduler and runner exist, before the first request; each gets a
    :class:`~warmcap.startup_hooks.StartupContext` and its result is kept in ``startup_results``
    under its name (``warmup``, ``graph_capture``). Start-up phases are reported to ``observer``
    (default: the one set by :func:`warmcap.startup_hooks.observing`) and logged on ``warmcap``.

    ``startup.audit_serving`` records and audits the KV writes of every serving step (invariant I2, as
    warmup is audited); a step that writes outside its blocks raises
    :class:`~warmcap.audit.kv_writes.AuditViolationError` and its requests are aborted. It copies slot
    mappings to the host each step, so it costs throughput: a debugging and CI switch.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        startup: StartupOptions | None = None,
        startup_hooks: Sequence[StartupHook] | None = None,
        observer: StartupObserver | None = None,
    ) -> None:
        startup = startup or StartupOptions()
        #: how start-up proved this engine (and whether every serving step is audited)
        self.startup_options = startup
        from warmcap.models.loader import load_hf_config

        observer = observer or current_observer()
        t_load = time.perf_counter()
        notify(observer, StartupEvent("load", f"model {config.model.model}"))
        self.device = resolve_device(config.model.device)
        self.model_path = resolve_model_path(config.model.model)
        hf_config = load_hf_config(self.model_path)
        # Fails on an unknown context limit before any weight is read, as `warmup plan` does.
        config = finish_config(config, hf_config)
        #: this rank's CPU model threads (count now, pinned while a step runs); None on a GPU.
        #: NOTE: planned before any worker is spawned, so a bad request fails alone.
        self.cpu_threads = start_threads(
            self.device.type,
            config.cpu_threads,
            config.cpu_threads_bind,
            world_size=config.tensor_parallel_size,
        )
        #: rank 0's side of tensor parallelism (None: one device); started before this rank's shard
        #: is loaded, as the shard is built by the group's parallel state
        self.executor: TPExecutor | None = None
        if config.tensor_parallel_size > 1:
            # Refused here, before any worker is spawned.
            check_tensor_parallel(model_class(hf_config.architectures[0]), config.tensor_parallel_size)
            self.executor = TPExecutor.start(config, self.model_path, self.device)
        try:
            hooks = startup_hooks_for(startup) if startup_hooks is None else startup_hooks
            self._start(config, hf_config, observer, t_load, startup.audit_serving, hooks)
        except BaseException:
            self.shutdown()
            raise

    def _start(
        self,
        config: EngineConfig,
        hf_config: Any,
        observer: StartupObserver,
        t_load: float,
        audit_serving: bool,
        startup_hooks: Sequence[StartupHook],
    ) -> None:
        from warmcap.models.loader import load_model, load_tokenizer
        from warmcap.runner_v2.attention.selector import select_backend

        # NOTE: measured before the weights load, as `warmup plan` measures with none loaded;
        # assemble subtracts the weights by shape, so both get the same pool.
        free_bytes = free_memory_bytes(self.device)
        torch.manual_seed(config.model.seed)
        if self.device.type == "cpu":
            use_isa(config.kernel.cpu_isa)
        self.model = load_model(
            self.model_path,
            dtype=TORCH_DTYPES[config.model.dtype],
            device=self.device,
            batch_invariant=config.model.batch_invariant,
            kernels=config.kernel,
        )
        self.tokenizer = _try_tokenizer(partial(load_tokenizer, config=hf_config), self.model_path)
        #: the output text of every request: the tokenizer's decode, a request's new tokens at a time
        self.detokenizer = TextDecoder(self.tokenizer, skip_special_tokens=True)
        # Under tensor parallelism every rank holds the whole drafter (no-op on one device).
        with replicated():
            self.drafter = build_drafter(config, self.model)
        t_kv = time.perf_counter()
        notify(observer, StartupEvent("load", str(self.model_path), finished=True, seconds=t_kv - t_load))
        notify(observer, StartupEvent("kv_sizing", "KV groups and pool size"))
        assembly = assemble(
            config, hf_config, self.model, self.drafter, device=self.device, free_bytes=free_bytes
        )
        self.kv_groups = assembly.kv_groups
        self.config = config = resolve_async_scheduling(assembly.config, self.device, self.kv_groups)
        executor = self.executor
        self.num_blocks = (
            assembly.num_blocks if executor is None else executor.agree_num_blocks(assembly.num_blocks)
        )
        self.kv_cache_manager = KVCacheManager(
            self.kv_groups,
            self.num_blocks,
            max_model_len=config.max_model_len,
            enable_caching=config.cache.enable_prefix_caching,
        )
        connector = build_kv_connector(config, self.kv_groups)
        self.scheduler = Scheduler(
            config,
            self.kv_cache_manager,
            eos_token_id=_eos_id(self.tokenizer, hf_config),
            connector=None if connector is None else connector[0],
        )
        make_runner = ModelRunner if executor is None else executor.make_runner
        self.runner = make_runner(
            config,
            self.model,
            self.kv_groups,
            self.num_blocks,
            device=self.device,
            attn_backend=select_backend(
                self.device,
                name=config.model.attention_backend,
                batch_invariant=config.model.batch_invariant,
                cpu_attention=config.kernel.cpu_attention,
            ),
            drafter=self.drafter,
        )
        self.spec_metrics = SpecDecodeMetrics()
        #: async scheduling: the step launched last, whose outputs the next :meth:`step` returns
        self._inflight: tuple[SchedulerOutput, StepResult] | None = None
        self._requests: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        #: seconds per start-up phase: load (weights, tokenizer, drafter), kv_sizing (groups, pool,
        #: caches, runner buffers), then one entry per hook
        self.startup_timings: dict[str, float] = {
            "load": t_kv - t_load,
            "kv_sizing": time.perf_counter() - t_kv,
        }
        notify(
            observer,
            StartupEvent(
                "kv_sizing",
                f"{self.num_blocks} blocks, max_model_len {config.max_model_len}",
                finished=True,
                seconds=self.startup_timings["kv_sizing"],
            ),
        )
        self.startup_hooks: list[StartupHook] = list(startup_hooks)
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
            observer=observer,
        )
        #: the per-step KV-write audit (None: ``audit_serving`` is off)
        self.serving_audit = (
            ServingAudit.of(self.runner, self.kv_cache_manager, self.kv_groups) if audit_serving else None
        )
        for hook in self.startup_hooks:
            t_hook = time.perf_counter()
            name = hook_name(hook)
            notify(observer, StartupEvent(name))
            self.startup_results[name] = (
                hook(self.startup_context)
                if executor is None
                else executor.run_hook(hook, self.startup_context)
            )
            self.startup_timings[name] = time.perf_counter() - t_hook
            notify(observer, StartupEvent(name, finished=True, seconds=self.startup_timings[name]))
        #: the KV connector's worker side (P/D; None without ``kv_transfer``), attached once warmup
        #: and graph capture are done with the KV cache
        self.kv_connector_worker = None if connector is None else connector[1]
        if self.kv_connector_worker is not None:
            self.runner.attach_kv_connector(self.kv_connector_worker)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker ranks (nothing to do on one device); idempotent. The
        engine runs no more steps afterwards under TP."""
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()

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
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        num_external_computed_tokens: int = 0,
        kv_transfer_params: dict | None = None,
    ) -> str:
        """Queue one prompt (text, token ids, or a ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``
        dict); returns its request id. Everything is checked before anything is queued.

        ``num_external_computed_tokens``: leading prompt tokens whose KV is loaded from outside (a
        P/D consumer's remote prefill) instead of computed here; the request waits, running no
        forward, until they have arrived (``core/scheduler.py``).

        ``kv_transfer_params``: the reference engine's P/D parameters (``{"do_remote_decode": true}``
        on a prefill instance, the prefill instance's answer on a decode instance; ``docs/pd.md``)."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ConfigError(
                f"add_request queues one sample, got n={params.n}: use generate() for n samples, or add "
                "n requests with their own seeds"
            )
        text, token_ids = self._prepare(prompt)
        if not 0 <= num_external_computed_tokens < len(token_ids):
            raise ConfigError(
                f"num_external_computed_tokens {num_external_computed_tokens} is outside 0..{len(token_ids) - 1}: "
                "at most every prompt token but the last can be loaded (the last is computed here to sample)"
            )
        if kv_transfer_params is not None:
            check_transfer_params(kv_transfer_params, self.config)
        req_id = request_id if request_id is not None else self._next_id()
        self._enqueue(
            req_id,
            text,
            token_ids,
            params,
            external=num_external_computed_tokens,
            transfer=kv_transfer_params,
        )
        return req_id

    def _next_id(self) -> str:
        return f"req-{next(self._ids)}"

    def _prepare(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        text, token_ids = split_prompt(prompt)
        if token_ids is None:
            token_ids = self.encode(text or "")
        if not token_ids:
            given = f"the text {text!r} encodes to no token" if text is not None else "no token ids"
            raise ConfigError(f"empty prompt ({given}): give at least one token to generate from")
        check_token_ids(token_ids, self.vocab_size)
        return text, token_ids

    def _enqueue(
        self,
        req_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        *,
        external: int = 0,
        transfer: dict | None = None,
    ) -> None:
        now = time.monotonic()
        if params.min_tokens:
            params = params.with_eos(self.scheduler.eos_token_id)
        request = Request(
            req_id,
            list(token_ids),
            params,
            arrival_time=now,
            num_external_computed_tokens=external,
            kv_transfer_params=None if transfer is None else dict(transfer),
        )
        self.scheduler.add_request(request)
        self._requests[req_id] = _Tracked(
            request,
            text,
            RequestMetrics(now, num_prompt_tokens=len(token_ids)),
            index=index,
            logprobs=None if params.logprobs is None else [],
            prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(token_ids),
        )

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may use: ``[0, vocab_size)``."""
        return int(self.model.hf_config.vocab_size)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False when it is unknown or already finished."""
        self._requests.pop(request_id, None)
        return self.scheduler.abort_request(request_id)

    def _abort_all(self, request_ids: Iterable[str]) -> None:
        for req_id in list(request_ids):
            self.abort(req_id)

    def has_unfinished(self) -> bool:
        """Requests to run, a step whose outputs are not returned yet, or blocks a producer keeps
        for a peer (steps poll for its read)."""
        return (
            self.scheduler.has_unfinished_requests()
            or self._inflight is not None
            or bool(self.scheduler.sending)
        )

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns an output for every request that gained tokens.

        With async scheduling (``config.scheduler.async_scheduling``) one step stays in flight:
        this call schedules and launches the next step, then returns the outputs of the one
        launched before it (so the first call returns none, and a request's last output may come
        a call after its last step); tokens are the same as without.

        NOTE: any error inside the step (a failing forward, non-finite logits, Ctrl-C) aborts the
        requests of that step and frees their blocks before it propagates; other queued requests
        stay and the engine remains usable.
        """
        if self.config.scheduler.async_scheduling:
            return self._step_async()
        sched_out = self._schedule()
        record = self._launch(sched_out, self.runner.execute_model_result)
        return self._process(sched_out, record)

    def _launch(
        self,
        sched_out: SchedulerOutput,
        execute: Callable[[SchedulerOutput], StepResult],
        failing_too: Sequence[SchedulerOutput] = (),
    ) -> StepResult:
        """Run ``execute(sched_out)`` audited and pinned; on any error the requests of this step
        (and of ``failing_too``, the steps that fail with it) are aborted before it propagates."""
        try:
            with self._audited(), self.steps_pinned():
                return execute(sched_out)
        except BaseException:
            self._fail_steps([*failing_too, sched_out])
            raise

    def _schedule(self) -> SchedulerOutput:
        try:
            return self.scheduler.schedule()
        except BaseException:
            self._abort_all(r.request_id for r in self.scheduler.running)
            raise

    def _step_async(self) -> list[RequestOutput]:
        """Schedule and launch the next step, then process the one in flight (see :meth:`step`)."""
        previous, self._inflight = self._inflight, None
        sched_out = self._schedule()
        record = self._launch(
            sched_out, self.runner.execute_model_async, () if previous is None else (previous[0],)
        )
        outputs: list[RequestOutput] = []
        if previous is not None:
            try:
                outputs = self._process(*previous)
            except BaseException:
                # The launched step carries the same requests: they fail with the one that failed.
                self._fail_steps([sched_out])
                raise
        if sched_out.is_empty:
            # Nothing ran: its transfers and finished requests are reported now, nothing is in flight.
            return outputs + self._process(sched_out, record)
        self._inflight = (sched_out, record)
        return outputs

    def _process(self, sched_out: SchedulerOutput, record: StepResult) -> list[RequestOutput]:
        """Apply an executed step's results: the scheduler's update, logprobs, stop strings, metrics;
        returns an output for every request that gained tokens."""
        try:
            runner_out = record.result()
            logits = self._step_logits(sched_out, record)
            results = self.scheduler.update_from_output(sched_out, runner_out)
            failed = self._end_failed_loads(runner_out.failed_recving)
        except BaseException:
            self._fail_steps([sched_out])
            raise
        now = time.monotonic()
        if record.prompt_logprobs:
            for req_id, part in record.prompt_logprobs.items():
                tracked = self._requests.get(req_id)
                if tracked is not None:
                    tracked.add_prompt_logprobs(part, self.decode)
        outputs = []
        for res in results:
            tracked = self._requests.get(res.req_id)
            if tracked is None:
                continue
            res = apply_stop_strings(tracked, res, self.detokenizer)
            if res.finished and tracked.stop is not None:
                self.scheduler.abort_request(res.req_id)  # frees its blocks now
            if tracked.logprobs is not None and res.new_token_ids and logits is not None:
                rows = logits[res.req_id][: len(res.new_token_ids)]
                tracked.logprobs += token_logprobs(
                    rows, res.new_token_ids, tracked.request.sampling_params.logprobs or 0, self.detokenizer
                )
            m = tracked.metrics
            if m.first_token_time is None and res.new_token_ids:
                m.first_token_time = now
            self.spec_metrics.observe(res.num_draft_tokens, res.num_accepted_tokens)
            m.num_draft_tokens += res.num_draft_tokens
            m.num_accepted_tokens += res.num_accepted_tokens
            if res.finished:
                m.finished_time = now
                del self._requests[res.req_id]
            elif tracked.final_only:
                continue
            outputs.append(tracked.output(self.detokenizer, res.new_token_ids, res.finish_reason))
        return outputs + failed

    def _fail_steps(self, sched_outs: Sequence[SchedulerOutput]) -> None:
        """A step failed: abort the requests of ``sched_outs`` (and of the step in flight) and drop
        them from the runner's batch."""
        if self._inflight is not None:
            sched_outs = [*sched_outs, self._inflight[0]]
            self._inflight = None
        gone: set[str] = set()
        for out in sched_outs:
            self._abort_all(out.num_scheduled_tokens)
            gone |= out.finished_req_ids | out.preempted_req_ids | set(out.num_scheduled_tokens)
        self._release_rows(gone)

    def _end_failed_loads(self, failures: dict[str, str]) -> list[RequestOutput]:
        """Requests whose KV could not be loaded end now, freeing their blocks; each output says why."""
        outputs = []
        for req_id, reason in failures.items():
            tracked = self._requests.pop(req_id, None)
            self.scheduler.abort_request(req_id)
            if tracked is not None:
                out = tracked.output(self.detokenizer, [], "abort")
                out.error = reason
                outputs.append(out)
        return outputs

    def _audited(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if self.serving_audit is None else self.serving_audit.step()

    def steps_pinned(self) -> contextlib.AbstractContextManager[None]:
        """Hold the CPU thread pinning across every :meth:`step` this thread makes inside the block
        (``generate`` does; each step holds it for itself too): a step inside it sets and restores
        no affinity of its own (``kernels/cpu/threads.CpuThreads.pinned``). A thread started inside
        the block inherits the one core, so callers that run other work between steps (the server)
        pin per step."""
        threads = getattr(self, "cpu_threads", None)
        return contextlib.nullcontext() if threads is None else threads.pinned()

    def _release_rows(self, req_ids: set[str]) -> None:
        """Drop ``req_ids`` from the runner's persistent batch now: the failed step may never have
        delivered them, and a preempted request must not find its old row when it resumes."""
        # NOTE: the step's own error is the one worth reporting; a runner too broken to drop rows
        # fails again, loudly, on the next step.
        with contextlib.suppress(Exception):
            self.runner.execute_model(SchedulerOutput(finished_req_ids=req_ids))

    def _step_logits(self, sched_out: SchedulerOutput, record: StepResult) -> _LogitsRows | None:
        """Each request's sampling logits rows of an executed step; raises when any is non-finite.

        NOTE: a NaN row argmaxes to an arbitrary token, so a broken checkpoint would otherwise
        "generate" silently. NaN or Inf anywhere in a row makes the row's sum non-finite, so one
        reduction per step catches it (raw logits are never masked to -inf).
        """
        if record.nonfinite_req_ids:
            self._non_finite(sorted(record.nonfinite_req_ids))
        logits = record.logits
        step = record.step
        if logits is None or step is None or sched_out.is_empty:
            return None
        # (a decode step samples every request: no reduction over its counts)
        if not step.decode and not step.num_logits.any():
            return None
        counts = step.num_logits.tolist()
        # The runner fetched the batch's verdict with the tokens; only a bad batch reads again.
        if not record.logits_finite:
            finite = torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))
            owners = [r for r, n in zip(step.req_ids, counts, strict=True) for _ in range(n)]
            self._non_finite(sorted({owners[i] for i in (~finite).nonzero().flatten().tolist()}))
        return _LogitsRows(step.req_ids, counts, logits)

    def _non_finite(self, req_ids: list[str]) -> None:
        raise NonFiniteLogitsError(
            f"model {self.model_path} produced non-finite logits (NaN or Inf) for {len(req_ids)} "
            f"request(s) ({', '.join(req_ids)}), so no token can be sampled; its weights hold NaN/Inf "
            f"or overflow {self.config.model.dtype}: check the checkpoint, or try dtype float32"
        )

    def generate(
        self,
        prompts: Sequence[PromptType],
        params: Sequence[SamplingParams],
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; one output per prompt, in prompt order, holding ``n``
        completions each. Only this call's requests are returned; on any error (Ctrl-C included)
        they are all aborted and their blocks freed before the error propagates.

        Only the final outputs are read, so the requests are queued with
        ``RequestOutputKind.FINAL_ONLY`` (as vLLM's ``LLM.generate`` does): their steps build no
        intermediate output."""
        groups: list[tuple[str, list[str]]] = []
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                if sp.output_kind is not RequestOutputKind.FINAL_ONLY:
                    sp = dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                text, token_ids = self._prepare(prompt)
                parent = self._next_id()
                children = [parent] if sp.n == 1 else [f"{parent}-{i}" for i in range(sp.n)]
                groups.append((parent, children))
                for i, child in enumerate(children):
                    self._enqueue(child, text, token_ids, sp.for_sample(i), index=i)
            done = self._run_to_completion([c for _, cs in groups for c in cs], use_tqdm)
        except BaseException:
            self._abort_all(c for _, cs in groups for c in cs)
            raise
        return [
            done[cs[0]] if len(cs) == 1 else gather_samples([done[c] for c in cs], parent)
            for parent, cs in groups
        ]

    def _run_to_completion(self, req_ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        tracked = {r: self._requests[r] for r in req_ids}
        done: dict[str, RequestOutput] = {}
        with progress_bar(len(req_ids), enabled=use_tqdm) as advance, self.steps_pinned():
            while len(done) < len(req_ids) and self.has_unfinished():
                for out in self.step():
                    if out.finished and out.request_id in tracked and out.request_id not in done:
                        done[out.request_id] = out
                        advance()
        for req_id, t in tracked.items():
            if req_id not in done:  # aborted by another caller meanwhile
                done[req_id] = t.output(self.detokenizer, [], "abort")
        return done

    def stream(self, prompt: PromptType, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request as it grows (deltas), running the engine meanwhile.

        Closing the iterator early (or an error) aborts the request. It reads the request's
        cumulative outputs whatever ``params.output_kind`` says.
        """
        params = params or SamplingParams()
        if params.output_kind is not RequestOutputKind.CUMULATIVE:
            params = dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE)
        req_id = self.add_request(prompt, params)
        stops = params.stop
        # Text that may turn out to start a stop string is held back until it is decided.
        hold = max(map(len, stops), default=1) - 1
        shown = ""
        finished = False
        try:
            while not finished and self.has_unfinished():
                for out in self.step():
                    if out.request_id != req_id:
                        continue
                    finished = out.finished
                    # A token may complete a multi-byte character only with the next one: hold back "�".
                    text = out.text
                    if not finished:
                        text = text.rstrip("\ufffd")
                        text = text[: max(0, len(text) - hold)]
                    if len(text) > len(shown) and text.startswith(shown):
                        yield text[len(shown) :]
                        shown = text
        finally:
            if not finished:
                self.abort(req_id)

    # ---- text ----------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """A text prompt's token ids with the tokenizer's own special tokens (BOS where it adds one),
        as ``transformers`` and vLLM encode it."""
        if self.tokenizer is None:
            raise ConfigError(f"{self.model_path} has no tokenizer: pass prompt token ids instead of text")
        return encode_text(self.tokenizer, text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.detokenizer(token_ids)


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


__all__ = [
    "DEFAULT_STARTUP_HOOKS",
    "CompletionOutput",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "startup_hooks_for",
]


class _LogitsRows:
    """Each request's sampling logits rows of a step, sliced on first use: only requests returning
    logprobs read theirs, so a step without any slices nothing."""

    __slots__ = ("_counts", "_logits", "_req_ids", "_starts")

    def __init__(self, req_ids: Sequence[str], counts: Sequence[int], logits: torch.Tensor) -> None:
        self._req_ids, self._counts, self._logits = req_ids, counts, logits
        self._starts: dict[str, tuple[int, int]] | None = None

    def __getitem__(self, req_id: str) -> torch.Tensor:
        if self._starts is None:
            starts, offset = {}, 0
            for r, n in zip(self._req_ids, self._counts, strict=True):
                starts[r] = (offset, offset + n)
                offset += n
            self._starts = starts
        start, end = self._starts[req_id]
        return self._logits[start:end]
