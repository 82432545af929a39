"""The engine's own thread: start-up, then step while there is work, fed through a queue.

``LLMEngine`` is synchronous and not thread-safe, so exactly one thread touches it. HTTP handlers
(on the asyncio loop) hand it commands through a :class:`queue.Queue`; it hands outputs back to each
request's :class:`asyncio.Queue` with ``call_soon_threadsafe``. Requests that arrive while a step
runs join the running batch at the next step (continuous batching).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from warmcap.audit.kv_writes import AuditViolationError
from warmcap.audit.serving import ServingAuditCounts
from warmcap.errors import ConfigError, WarmcapError
from warmcap.metrics import SpecDecodeMetrics
from warmcap.serve.chat import ChatPrompt, chat_token_ids

if TYPE_CHECKING:
    from warmcap.engine import LLMEngine, RequestOutput
    from warmcap.sampling_params import SamplingParams
    from warmcap.serve.metrics import ServingMetrics
    from warmcap.serve.startup_facts import StartedEngine

log = logging.getLogger("warmcap.serve")

#: how often an engine with only KV transfers pending looks at them
_TRANSFER_POLL_S = 0.002

#: Gathering a burst. When work reaches an idle engine, it waits up to ``_GATHER_IDLE_FIRST_S`` for a
#: second request, then ``_GATHER_IDLE_GAP_S`` after each one that comes, at most
#: ``_GATHER_IDLE_MAX_S`` in all, before it schedules; after a step that ended requests (closed-loop
#: clients send their next request as soon as the last one ends) it waits ``_GATHER_FIRST_S``, then
#: ``_GATHER_GAP_S`` after each, at most ``_GATHER_MAX_S`` (short: the running requests wait too).
#: Without it the first request of a burst takes a step alone (a prefill of hundreds of milliseconds
#: on CPU) and the rest, arriving milliseconds later, wait for that step; vLLM's front end hands its
#: engine process requests in batches. Measured under ``vllm bench serve`` at 32 clients on 2 cores
#: (BENCHMARKS.md, "Serving at 32 clients: ..."): a burst's first request reached the engine
#: 8.9 ms before its second, the rest mostly 0.3 ms apart, but with a pause somewhere that a 2 ms
#: gap took for the end (11 of 32 in the first step, 3 prefill steps instead of 2). A lone request
#: pays at most ``_GATHER_IDLE_FIRST_S``; a step that ended requests at most ``_GATHER_MAX_S``.
_GATHER_IDLE_FIRST_S = 0.012
_GATHER_IDLE_GAP_S = 0.010
_GATHER_IDLE_MAX_S = 0.060
_GATHER_FIRST_S = 0.005
_GATHER_GAP_S = 0.002
_GATHER_MAX_S = 0.010


class State(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class EngineFailure:
    """Sent instead of an output when a request cannot go on (shutdown, engine error)."""

    message: str
    status: int = 503


#: What a request's queue receives: ``(index, output)``; a finished output or a failure is the last.
Item = tuple[int, "RequestOutput | EngineFailure"]


@dataclass(slots=True)
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Item]
    index: int
    arrival: float
    first_token_seen: bool = False

    def put(self, item: RequestOutput | EngineFailure) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, item))


@dataclass(frozen=True, slots=True)
class StartFailure:
    """Why start-up did not end ready; ``bad_input`` when the model or options given are unusable
    (a :class:`WarmcapError` other than an audit violation: the CLI exits 2, else 1)."""

    reason: str
    bad_input: bool = False


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt: str | list[int] | ChatPrompt
    params: SamplingParams
    sink: _Sink
    kv_transfer_params: dict | None = None
    #: the request named no ``max_tokens``: it gets what the context leaves after its prompt
    fill_max_tokens: bool = False


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Stop:
    reason: str


class EngineLoop:
    """Owns the engine: runs ``start`` (the audited start-up) then serves commands until stopped.

    ``on_failure`` is called (from the engine thread) with a :class:`StartFailure` when start-up
    fails or the audit refuses the engine, so the process can exit non-zero.
    """

    def __init__(
        self,
        start: Callable[[], StartedEngine],
        metrics: ServingMetrics,
        *,
        num_spec_positions: int = 0,
        on_failure: Callable[[StartFailure], None] | None = None,
    ) -> None:
        self._start = start
        self._metrics = metrics
        self._num_spec_positions = num_spec_positions
        self._on_failure = on_failure
        self._commands: queue.Queue[_Add | _Abort | _Stop] = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        # NOTE: held while leaving READY and while queueing a request, so no request is queued
        # after the engine thread's last look at the queue (it would wait forever).
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="warmcap-engine", daemon=True)
        self.state = State.STARTING
        self.failure: str | None = None
        self.started: StartedEngine | None = None
        #: serving steps the KV-write audit failed (``--audit-serving``; each raised and ended its step)
        self.audit_failed_steps = 0

    @property
    def engine(self) -> LLMEngine:
        """The started engine (only once :attr:`state` is READY)."""
        assert self.started is not None, "the engine is not started yet"
        return self.started.engine

    def serving_audit_counts(self) -> ServingAuditCounts | None:
        """``--audit-serving``'s running counts since start-up; None when the audit is off (or
        the engine not started)."""
        audit = self.started.engine.serving_audit if self.started is not None else None
        if audit is None:
            return None
        failed = self.audit_failed_steps
        return ServingAuditCounts(audit.totals.steps + failed, audit.totals.slots_checked, failed)

    def spec_metrics(self) -> SpecDecodeMetrics:
        """The engine's running spec-decode totals; empty before start-up finishes."""
        return self.started.engine.spec_metrics if self.started is not None else SpecDecodeMetrics()

    # ---- called from the asyncio side ----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(
        self,
        request_id: str,
        prompt: str | list[int] | ChatPrompt,
        params: SamplingParams,
        out: asyncio.Queue[Item],
        index: int = 0,
        kv_transfer_params: dict | None = None,
        *,
        fill_max_tokens: bool = False,
    ) -> None:
        """Queue a request; its outputs go to ``out`` tagged with ``index``. Prompt problems (empty,
        too long, ``max_tokens`` beyond the context, no chat template) come back as an
        :class:`EngineFailure` with status 400. ``fill_max_tokens``: the request named no limit, so
        it may generate up to the end of the context."""
        sink = _Sink(asyncio.get_running_loop(), out, index, time.monotonic())
        with self._lock:
            if self.state is not State.READY:
                sink.put(EngineFailure(f"the server is not serving (state: {self.state.value})"))
                return
            self._commands.put(_Add(request_id, prompt, params, sink, kv_transfer_params, fill_max_tokens))

    def abort(self, request_ids: Sequence[str]) -> None:
        """Stop requests and free their blocks (no-op for ones already finished)."""
        for request_id in request_ids:
            self._commands.put(_Abort(request_id))

    def shutdown(self, reason: str = "the server is shutting down") -> None:
        """Ask the engine thread to end every in-flight request with an error and exit."""
        self._commands.put(_Stop(reason))

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            started = self._start()
        except Exception as exc:  # any start-up failure must reach the operator, not kill a thread
            if isinstance(exc, WarmcapError):
                self._fail(StartFailure(str(exc), bad_input=not isinstance(exc, AuditViolationError)))
            else:
                self._fail(StartFailure(f"{type(exc).__name__}: {exc}"))
            return
        self.started = started
        self._metrics.set_startup(started.facts)
        if started.refusal is not None:
            self._fail(StartFailure(started.refusal))
            return
        # The smoke generation of start-up is in the report; /metrics counts served requests only.
        started.engine.spec_metrics = SpecDecodeMetrics(accepted_per_pos=[0] * self._num_spec_positions)
        self.state = State.READY
        self._metrics.set_ready()
        log.info("warmcap: engine ready")
        self._serve(started.engine)

    def _fail(self, failure: StartFailure) -> None:
        self.failure = failure.reason
        self.state = State.FAILED
        log.error("warmcap: start-up failed: %s", failure.reason)
        if self._on_failure is not None:
            self._on_failure(failure)

    def _serve(self, engine: LLMEngine) -> None:
        ended = False
        while True:
            idle = not engine.has_unfinished()
            # Only KV transfers pending (a producer's kept blocks, a consumer's reads): poll them
            # every few milliseconds instead of stepping in a busy loop.
            polling = not idle and not engine.scheduler.running and not engine.scheduler.waiting
            commands = self._drain(block=idle, timeout=_TRANSFER_POLL_S if polling else None)
            if idle and commands:
                commands += self._gather(_GATHER_IDLE_FIRST_S, _GATHER_IDLE_GAP_S, _GATHER_IDLE_MAX_S)
            elif ended:
                commands += self._gather(_GATHER_FIRST_S, _GATHER_GAP_S, _GATHER_MAX_S)
            ended = False
            for i, command in enumerate(commands):
                if isinstance(command, _Stop):
                    self._stop(engine, command.reason, commands[i + 1 :])
                    return
                if isinstance(command, _Add):
                    self._add(engine, command)
                elif self._sinks.pop(command.request_id, None) is not None:
                    engine.abort(command.request_id)
                    self._metrics.observe_end("abort", None)
            if engine.has_unfinished():
                ended = self._step(engine)
            else:
                # Aborts free blocks without a step: the gauges must show it.
                self._observe(engine, num_batched=0)

    def _drain(self, *, block: bool, timeout: float | None = None) -> list[_Add | _Abort | _Stop]:
        commands = []
        if block:
            commands.append(self._commands.get())
        elif timeout is not None:
            try:
                commands.append(self._commands.get(timeout=timeout))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _gather(self, first_wait: float, gap: float, max_wait: float) -> list[_Add | _Abort | _Stop]:
        """Commands arriving within ``first_wait``, then within ``gap`` of each other, for at most
        ``max_wait`` (see ``_GATHER_IDLE_FIRST_S``)."""
        got: list[_Add | _Abort | _Stop] = []
        deadline = time.monotonic() + max_wait
        wait = first_wait
        while True:
            left = min(wait, deadline - time.monotonic())
            if left <= 0:
                return got
            try:
                got.append(self._commands.get(timeout=left))
            except queue.Empty:
                return got
            wait = gap

    def _add(self, engine: LLMEngine, command: _Add) -> None:
        prompt = command.prompt
        try:
            text = None
            if isinstance(prompt, ChatPrompt):
                token_ids = chat_token_ids(engine.tokenizer, prompt.messages, engine.config.model.model)
            elif isinstance(prompt, str):
                text, token_ids = prompt, engine.encode(prompt)
            else:
                token_ids = list(prompt)
                _check_token_ids(engine, token_ids)
            params = _fit_to_context(command.params, len(token_ids), engine.config.max_model_len, command)
            engine.add_request(
                token_ids if text is None else {"prompt": text, "prompt_token_ids": token_ids},
                params,
                command.request_id,
                kv_transfer_params=command.kv_transfer_params,
            )
        except WarmcapError as exc:
            command.sink.put(EngineFailure(str(exc), status=400))
            return
        self._sinks[command.request_id] = command.sink

    def _step(self, engine: LLMEngine) -> bool:
        """One engine step, its outputs handed to their requests; True when it ended a request."""
        try:
            outputs = engine.step()
        except Exception as exc:  # a failed step must not leave clients waiting forever
            if isinstance(exc, AuditViolationError):
                self.audit_failed_steps += 1
            log.exception("warmcap: engine step failed")
            # The engine aborted the step's own requests; the rest (queued, loading) go on. A step
            # that aborted none cannot be told from the next, so then every request ends.
            ended = [r for r in self._sinks if r not in engine.scheduler.requests] or list(self._sinks)
            self._end(engine, ended, f"the engine failed: {type(exc).__name__}: {exc}", status=500)
            return bool(ended)
        any_ended = False
        now = time.monotonic()
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            self._metrics.observe_tokens(generated=len(out.new_token_ids))
            if not sink.first_token_seen and out.new_token_ids:
                sink.first_token_seen = True
                self._metrics.observe_tokens(prompt=len(out.prompt_token_ids))
                self._metrics.observe_first_token(now - sink.arrival)
            if out.error is not None:
                # A failed KV transfer: the request ends with the reason, the server goes on.
                del self._sinks[out.request_id]
                self._metrics.observe_end("abort", None)
                sink.put(EngineFailure(out.error, status=502))
                any_ended = True
                continue
            if out.finished:
                any_ended = True
                del self._sinks[out.request_id]
                self._metrics.observe_end(out.finish_reason or "stop", now - sink.arrival)
            sink.put(out)
        self._observe(engine, num_batched=len(outputs))
        return any_ended

    def _observe(self, engine: LLMEngine, *, num_batched: int) -> None:
        self._metrics.observe_step(
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            kv_usage=engine.kv_cache_manager.usage,
            num_batched=num_batched,
        )

    def _end_all(self, engine: LLMEngine, reason: str, status: int = 503) -> None:
        self._end(engine, list(self._sinks), reason, status)

    def _end(self, engine: LLMEngine, request_ids: list[str], reason: str, status: int) -> None:
        for request_id in request_ids:
            sink = self._sinks.pop(request_id)
            engine.abort(request_id)
            self._metrics.observe_end("abort", None)
            sink.put(EngineFailure(reason, status))
        self._observe(engine, num_batched=0)

    def _stop(self, engine: LLMEngine, reason: str, pending: list[_Add | _Abort | _Stop]) -> None:
        with self._lock:
            self.state = State.STOPPED
            queued = pending + self._drain(block=False)
        self._end_all(engine, reason)
        # Queued but never added: they did not reach the engine.
        for command in queued:
            if isinstance(command, _Add):
                command.sink.put(EngineFailure(reason))
        pool = engine.kv_cache_manager.pool
        log.info(
            "warmcap: engine stopped; %d of %d KV blocks free", pool.num_free_blocks, engine.num_blocks - 1
        )


def _check_token_ids(engine: LLMEngine, token_ids: list[int]) -> None:
    """A token id outside the vocabulary would fail the whole step, and every request in it."""
    vocab = getattr(getattr(engine.model, "hf_config", None), "vocab_size", None)
    bad = [t for t in token_ids if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise ConfigError(
            f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab}); send ids the model's tokenizer produces"
        )


def _fit_to_context(
    params: SamplingParams, num_prompt: int, max_model_len: int, command: _Add
) -> SamplingParams:
    """``params`` with ``max_tokens`` the context leaves when the request named none; a named one
    that does not fit beside the prompt is refused (as vLLM's server refuses it). A prompt that
    fills the context is left to ``add_request``, whose error says so."""
    room = max_model_len - num_prompt
    if room <= 0 or num_prompt == 0:
        return params
    if command.fill_max_tokens:
        return replace(params, max_tokens=room)
    if params.max_tokens > room:
        raise ConfigError(
            f"max_tokens {params.max_tokens} is too large: this model's context is {max_model_len} tokens "
            f"and the prompt has {num_prompt}, which leaves room for {room} new tokens "
            f"({params.max_tokens} > {max_model_len} - {num_prompt}); lower max_tokens or shorten the prompt"
        )
    return params
