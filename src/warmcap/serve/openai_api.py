"""``POST /v1/completions`` and ``POST /v1/chat/completions``: requests to the engine loop, outputs
back as one JSON body or as server-sent events ending in ``data: [DONE]``.

Each of a request's prompts is queued ``n`` times with :meth:`SamplingParams.for_sample`, as
``LLM.generate`` queues them, so the same request gives the same choices as ``LLM.generate``.
A client that goes away aborts every engine request of its HTTP request, streamed or not, queued or
running: the engine loop frees their blocks before its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from warmcap.serve.chat import ChatPrompt
from warmcap.serve.engine_loop import EngineFailure, Item
from warmcap.serve.errors import APIError, error_body
from warmcap.serve.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_body
from warmcap.serve.params import chat_messages, chat_params, completion_params, completion_prompts, echo_only
from warmcap.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    Usage,
    usage,
)
from warmcap.serve.streaming import Sent

if TYPE_CHECKING:
    from warmcap.outputs import Logprob, RequestOutput, SampleLogprobs
    from warmcap.sampling_params import SamplingParams
    from warmcap.serve.state import ServerState

router = APIRouter()

#: the status a request gets when its client went away (nginx's convention; nobody reads it)
CLIENT_GONE = 499
_CODES = {400: "invalid_request", CLIENT_GONE: "client_disconnected", 502: "bad_gateway"}


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state: ServerState = request.app.state.warmcap
    state.check_ready()
    state.check_model(body.model)
    params = completion_params(body)
    prompts = completion_prompts(body.prompt)
    _check_transfer(body.kv_transfer_params, len(prompts) * params.n, params)
    run = _Run(state, "cmpl", len(prompts), params)
    await run.begin(request, prompts, params, body.kv_transfer_params)
    if body.stream:
        return _sse(run.completion_chunks(body), run)
    outputs = await run.collect()
    choices = []
    only_prompt = echo_only(body)
    for index, out in enumerate(outputs):
        c = out.outputs[0]
        # echo with max_tokens 0: the engine's one token is not part of the answer (as vLLM).
        token_ids, entries, text = ([], [], "") if only_prompt else (c.token_ids, c.logprobs, c.text)
        logprobs = None
        if body.logprobs is not None:
            logprobs = run.completion_logprobs(body, out, token_ids, entries or [], echo=body.echo)
        choices.append(
            CompletionChoice(
                index=index,
                text=(run.prompt_text(out) if body.echo else "") + text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_token_ids=out.prompt_token_ids if body.return_token_ids else None,
                token_ids=token_ids if body.return_token_ids else None,
                prompt_logprobs=prompt_logprobs_body(out.prompt_logprobs),
            )
        )
    return JSONResponse(
        CompletionResponse(
            id=run.id,
            model=body.model,
            choices=choices,
            usage=run.usage(outputs, completions=not only_prompt),
            kv_transfer_params=outputs[0].kv_transfer_params,
        ).model_dump()
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state: ServerState = request.app.state.warmcap
    state.check_ready()
    state.check_model(body.model)
    # Without a limit, answer until the context is full (the engine loop sets what the prompt leaves).
    params = chat_params(body, state.max_model_len)
    fill = body.max_completion_tokens is None and body.max_tokens is None
    prompt = ChatPrompt(chat_messages(body.messages))
    _check_transfer(body.kv_transfer_params, params.n, params)
    run = _Run(state, "chatcmpl", 1, params)
    await run.begin(request, [prompt], params, body.kv_transfer_params, fill_max_tokens=fill)
    if body.stream:
        return _sse(run.chat_chunks(body), run)
    outputs = await run.collect()
    choices = []
    for index, out in enumerate(outputs):
        c = out.outputs[0]
        logprobs = None
        if c.logprobs is not None:
            logprobs = chat_logprobs(c.token_ids, c.logprobs, body.top_logprobs or 0)
        choices.append(
            ChatChoice(
                index=index,
                message=AssistantMessage(content=c.text),
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if body.return_token_ids else None,
            )
        )
    return JSONResponse(
        ChatCompletionResponse(
            id=run.id,
            model=body.model,
            choices=choices,
            usage=run.usage(outputs),
            prompt_logprobs=prompt_logprobs_body(outputs[0].prompt_logprobs),
            prompt_token_ids=outputs[0].prompt_token_ids if body.return_token_ids else None,
            kv_transfer_params=outputs[0].kv_transfer_params,
        ).model_dump()
    )


def _check_transfer(kv_transfer_params: dict | None, num_requests: int, params: SamplingParams) -> None:
    if kv_transfer_params is not None and params.prompt_logprobs is not None:
        # A P/D consumer loads the prompt's KV: its positions never pass through this model's head.
        raise APIError(
            400,
            "prompt logprobs (echo with logprobs, or prompt_logprobs) need the prompt computed here, "
            "which kv_transfer_params skips: drop one of them",
            "invalid_parameter",
            "kv_transfer_params",
        )
    if kv_transfer_params is not None and num_requests != 1:
        raise APIError(
            400,
            f"kv_transfer_params goes with one prompt and n=1; this request makes {num_requests} "
            "completions: send them one by one",
            "invalid_parameter",
            "kv_transfer_params",
        )


class _Run:
    """The engine requests behind one HTTP request (``n`` per prompt; choice ``p * n + i`` is
    prompt ``p``'s ``i``-th sample) and their shared output queue."""

    def __init__(self, state: ServerState, prefix: str, num_prompts: int, params: SamplingParams) -> None:
        self.state = state
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.n = params.n
        self.stops = params.stop
        self.request_ids = [f"{self.id}-{i}" for i in range(num_prompts * self.n)]
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.finished: dict[int, RequestOutput] = {}
        self.first: Item | None = None
        self._watcher: asyncio.Task[None] | None = None

    async def begin(
        self,
        request: Request,
        prompts: list[str | list[int]] | list[ChatPrompt],
        params: SamplingParams,
        kv_transfer_params: dict | None = None,
        *,
        fill_max_tokens: bool = False,
    ) -> None:
        """Watch for the client going away, submit every sample of every prompt, and wait for the
        first output, so a rejected prompt still gets a plain error response rather than a stream."""
        self.state.check_ready()
        self._watcher = asyncio.create_task(self._watch(request))
        for p, prompt in enumerate(prompts):
            for i in range(self.n):
                index = p * self.n + i
                self.state.loop.submit(
                    self.request_ids[index],
                    prompt,
                    params.for_sample(i),
                    self.queue,
                    index,
                    kv_transfer_params,
                    fill_max_tokens=fill_max_tokens,
                )
        try:
            self.first = self._check(await self.queue.get())
        except BaseException:
            self.close()
            raise

    async def _watch(self, request: Request) -> None:
        """Abort every unfinished engine request once the client disconnects.

        NOTE: the body is read already, so the next ASGI message is the disconnect; a streaming
        response cancels its generator too, but only when it next tries to send, and a plain
        request would otherwise run to its end.
        """
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.abort()
        self.queue.put_nowait((-1, EngineFailure("the client disconnected", CLIENT_GONE)))

    def _check(self, item: Item) -> Item:
        index, out = item
        if isinstance(out, EngineFailure):
            self.close()
            raise APIError(out.status, out.message, _CODES.get(out.status, "engine_unavailable"))
        if out.finished:
            self.finished[index] = out
        return item

    async def items(self) -> AsyncIterator[Item]:
        """Every output in arrival order until all requests finished; a failure raises."""
        if self.first is not None:
            item, self.first = self.first, None
            yield item
        while len(self.finished) < len(self.request_ids):
            yield self._check(await self.queue.get())

    async def collect(self) -> list[RequestOutput]:
        try:
            async for _ in self.items():
                pass
        finally:
            self.close()
        return [self.finished[i] for i in range(len(self.request_ids))]

    def abort(self) -> None:
        self.state.loop.abort([r for i, r in enumerate(self.request_ids) if i not in self.finished])

    def close(self) -> None:
        """Abort what has not finished and stop watching the client."""
        self.abort()
        if self._watcher is not None:
            self._watcher.cancel()

    def usage(self, outputs: list[RequestOutput], *, completions: bool = True) -> Usage:
        """Each prompt's tokens once (not once per sample), every choice's generated tokens (none
        counted when the answer holds none: echo with max_tokens 0)."""
        prompt = sum(len(o.prompt_token_ids) for i, o in enumerate(outputs) if i % self.n == 0)
        return usage(prompt, sum(len(o.token_ids) for o in outputs) if completions else 0)

    def completion_logprobs(
        self,
        body: CompletionRequest,
        out: RequestOutput,
        token_ids: list[int],
        entries: SampleLogprobs,
        *,
        echo: bool,
        text_offset: int = 0,
    ) -> CompletionLogprobs:
        """The completions' ``logprobs`` of ``token_ids``; with ``echo`` the prompt's tokens and
        logprobs come first (its first token's null), offsets from the prompt's start."""
        ids: list[int] = list(token_ids)
        lps: list[dict[int, Logprob] | None] = list(entries)
        if echo:
            prompt = out.prompt_logprobs
            if prompt is None:  # NOTE: the engine sets them with the first token; never missing
                raise APIError(500, "the engine returned no prompt logprobs for an echo request")
            ids, lps = [*out.prompt_token_ids, *ids], [*prompt, *lps]
        decode = self.state.loop.engine.decode
        return completion_logprobs(ids, lps, body.logprobs or 0, text_offset, decode)

    def prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.state.loop.engine.decode(out.prompt_token_ids)

    async def completion_chunks(self, body: CompletionRequest) -> AsyncIterator[BaseModel]:
        sent = [Sent() for _ in self.request_ids]
        only_prompt = echo_only(body)
        async for index, out in self.items():
            assert not isinstance(out, EngineFailure)
            s = sent[index]
            first = s.num_tokens == 0 and not s.text
            echo = body.echo and first
            if only_prompt:
                # One chunk: the prompt (and its logprobs), once the engine's token is in.
                if not out.finished:
                    continue
                text, token_ids, entries = self.prompt_text(out), [], []
            else:
                if echo:
                    s.prefix = self.prompt_text(out)
                    # Without logprobs for the prompt's tokens, the first token starts after its text.
                    s.offset = 0 if body.logprobs is not None else len(s.prefix)
                delta = s.advance(out, self.stops)
                if delta is None:
                    continue
                text, token_ids, entries = delta
            logprobs = None
            if body.logprobs is not None and (entries is not None or echo):
                logprobs = self.completion_logprobs(
                    body, out, token_ids, entries or [], echo=echo, text_offset=s.offset
                )
                s.offset += sum(len(t) for t in logprobs.tokens)
            c = out.outputs[0]
            choice = CompletionChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_token_ids=out.prompt_token_ids if body.return_token_ids and first else None,
                token_ids=token_ids if body.return_token_ids else None,
            )
            yield CompletionResponse(id=self.id, model=body.model, choices=[choice])
        if body.stream_options and body.stream_options.include_usage:
            outs = [self.finished[i] for i in range(len(self.request_ids))]
            yield CompletionResponse(
                id=self.id, model=body.model, choices=[], usage=self.usage(outs, completions=not only_prompt)
            )

    async def chat_chunks(self, body: ChatCompletionRequest) -> AsyncIterator[BaseModel]:
        def chunk(index: int, delta: DeltaMessage, **fields: object) -> ChatCompletionChunk:
            choice = ChatChunkChoice(index=index, delta=delta, **fields)  # type: ignore[arg-type]
            return ChatCompletionChunk(id=self.id, model=body.model, choices=[choice])

        assert self.first is not None and not isinstance(self.first[1], EngineFailure)
        prompt_ids = self.first[1].prompt_token_ids
        for index in range(len(self.request_ids)):
            first = chunk(index, DeltaMessage(role="assistant", content=""))
            if body.return_token_ids and index == 0:
                first.prompt_token_ids = prompt_ids
            yield first
        sent = [Sent() for _ in self.request_ids]
        async for index, out in self.items():
            assert not isinstance(out, EngineFailure)
            delta = sent[index].advance(out, self.stops)
            if delta is None:
                continue
            text, token_ids, entries = delta
            c = out.outputs[0]
            yield chunk(
                index,
                DeltaMessage(content=text or None),
                logprobs=None
                if entries is None
                else chat_logprobs(token_ids, entries, body.top_logprobs or 0),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                token_ids=token_ids if body.return_token_ids else None,
            )
        if body.stream_options and body.stream_options.include_usage:
            outs = [self.finished[i] for i in range(len(self.request_ids))]
            yield ChatCompletionChunk(id=self.id, model=body.model, choices=[], usage=self.usage(outs))


def _sse(chunks: AsyncIterator[BaseModel], run: _Run) -> StreamingResponse:
    return StreamingResponse(_events(chunks, run), media_type="text/event-stream")


async def _events(chunks: AsyncIterator[BaseModel], run: _Run) -> AsyncIterator[str]:
    """``data: {json}`` per chunk, then ``data: [DONE]``; a failure mid-stream is an error event.

    NOTE: ``finally`` aborts the engine requests when the generator is cancelled or closed (the
    client went away) as well as when it ends.
    """
    try:
        async for chunk in chunks:
            yield f"data: {chunk.model_dump_json()}\n\n"
    except APIError as exc:
        yield f"data: {json.dumps(error_body(exc.status, exc.message, exc.code))}\n\n"
    finally:
        with contextlib.suppress(Exception):
            run.close()
    yield "data: [DONE]\n\n"
