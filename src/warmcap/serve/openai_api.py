"""``POST /v1/completions`` and ``POST /v1/chat/completions``: requests to the engine loop, outputs
back as one JSON body or as server-sent events ending in ``data: [DONE]``."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from warmcap.errors import ConfigError
from warmcap.sampling_params import SamplingParams
from warmcap.serve.chat import ChatPrompt
from warmcap.serve.engine_loop import EngineFailure, Item
from warmcap.serve.errors import APIError, error_body
from warmcap.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    usage,
)

if TYPE_CHECKING:
    from warmcap.engine import RequestOutput
    from warmcap.serve.app import ServerState

#: OpenAI's default for completions when ``max_tokens`` is not given.
DEFAULT_COMPLETION_TOKENS = 16

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state: ServerState = request.app.state.warmcap
    state.check_ready()
    state.check_model(body.model)
    params = _sampling_params(body, DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens)
    prompts = _completion_prompts(body.prompt)
    if body.kv_transfer_params is not None and len(prompts) != 1:
        raise APIError(
            400,
            f"kv_transfer_params goes with one prompt; this request has {len(prompts)}: send them one by one",
            "invalid_parameter",
            "kv_transfer_params",
        )
    run = await _Run.begin(state, prompts, params, "cmpl", body.kv_transfer_params)
    if body.stream:
        return _sse(run.completion_chunks(body), run)
    outputs = await run.collect()
    return JSONResponse(
        CompletionResponse(
            id=run.id,
            model=body.model,
            choices=[
                CompletionChoice(index=i, text=o.text, finish_reason=o.finish_reason)
                for i, o in enumerate(outputs)
            ],
            usage=usage(*_token_counts(outputs)),
            kv_transfer_params=outputs[0].kv_transfer_params,
        ).model_dump()
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state: ServerState = request.app.state.warmcap
    state.check_ready()
    state.check_model(body.model)
    # Without a limit, answer until the context is full (the engine stops at max_model_len).
    limit = next(
        (n for n in (body.max_completion_tokens, body.max_tokens) if n is not None), state.max_model_len
    )
    params = _sampling_params(body, limit)
    prompt = ChatPrompt(tuple((m.role, m.content) for m in body.messages))
    run = await _Run.begin(state, [prompt], params, "chatcmpl", body.kv_transfer_params)
    if body.stream:
        return _sse(run.chat_chunks(body), run)
    (out,) = await run.collect()
    return JSONResponse(
        ChatCompletionResponse(
            id=run.id,
            model=body.model,
            choices=[
                ChatChoice(
                    index=0, message=AssistantMessage(content=out.text), finish_reason=out.finish_reason
                )
            ],
            usage=usage(*_token_counts([out])),
            kv_transfer_params=out.kv_transfer_params,
        ).model_dump()
    )


def _sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
    kwargs: dict[str, object] = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "max_tokens": max_tokens,
        "ignore_eos": body.ignore_eos,
    }
    if body.top_k is not None:
        kwargs["top_k"] = body.top_k
    if body.stop:
        kwargs["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    try:
        return SamplingParams(**kwargs)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise APIError(400, str(exc), "invalid_parameter") from None


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(
            400, "prompt is empty: give a string, token ids, or a list of either", "invalid_prompt", "prompt"
        )
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def _token_counts(outputs: list[RequestOutput]) -> tuple[int, int]:
    return sum(len(o.prompt_token_ids) for o in outputs), sum(len(o.token_ids) for o in outputs)


class _Run:
    """The engine requests behind one HTTP request (one per prompt) and their shared output queue."""

    def __init__(self, state: ServerState, prefix: str, count: int) -> None:
        self.state = state
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.request_ids = [f"{self.id}-{i}" for i in range(count)]
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.finished: dict[int, RequestOutput] = {}
        self.first: Item | None = None

    @classmethod
    async def begin(
        cls,
        state: ServerState,
        prompts: list[str | list[int] | ChatPrompt],
        params: SamplingParams,
        prefix: str,
        kv_transfer_params: dict | None = None,
    ) -> _Run:
        """Submit every prompt and wait for the first output, so a rejected prompt still gets a
        plain error response rather than a stream."""
        state.check_ready()
        run = cls(state, prefix, len(prompts))
        for i, prompt in enumerate(prompts):
            state.loop.submit(run.request_ids[i], prompt, params, run.queue, i, kv_transfer_params)
        try:
            run.first = run._check(await run.queue.get())
        except BaseException:
            run.abort()
            raise
        return run

    def _check(self, item: Item) -> Item:
        index, out = item
        if isinstance(out, EngineFailure):
            self.abort()
            raise APIError(
                out.status, out.message, "invalid_prompt" if out.status == 400 else "engine_unavailable"
            )
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
        except BaseException:
            self.abort()
            raise
        return [self.finished[i] for i in range(len(self.request_ids))]

    def abort(self) -> None:
        self.state.loop.abort([r for i, r in enumerate(self.request_ids) if i not in self.finished])

    async def completion_chunks(self, body: CompletionRequest) -> AsyncIterator[BaseModel]:
        deltas = _Deltas(len(self.request_ids))
        async for index, out in self.items():
            assert not isinstance(out, EngineFailure)
            text = deltas.next(index, out)
            if text or out.finished:
                choice = CompletionChoice(index=index, text=text, finish_reason=out.finish_reason)
                yield CompletionResponse(id=self.id, model=body.model, choices=[choice])
        if body.stream_options and body.stream_options.include_usage:
            outs = [self.finished[i] for i in range(len(self.request_ids))]
            yield CompletionResponse(
                id=self.id, model=body.model, choices=[], usage=usage(*_token_counts(outs))
            )

    async def chat_chunks(self, body: ChatCompletionRequest) -> AsyncIterator[BaseModel]:
        def chunk(delta: DeltaMessage, reason: str | None = None) -> ChatCompletionChunk:
            choice = ChatChunkChoice(index=0, delta=delta, finish_reason=reason)
            return ChatCompletionChunk(id=self.id, model=body.model, choices=[choice])

        yield chunk(DeltaMessage(role="assistant", content=""))
        deltas = _Deltas(1)
        async for index, out in self.items():
            assert not isinstance(out, EngineFailure)
            text = deltas.next(index, out)
            if text:
                yield chunk(DeltaMessage(content=text))
            if out.finished:
                yield chunk(DeltaMessage(), out.finish_reason)
        if body.stream_options and body.stream_options.include_usage:
            yield ChatCompletionChunk(
                id=self.id, model=body.model, choices=[], usage=usage(*_token_counts([self.finished[0]]))
            )


class _Deltas:
    """New text per choice since the last chunk."""

    def __init__(self, count: int) -> None:
        self.shown = [""] * count

    def next(self, index: int, out: RequestOutput) -> str:
        # A token may complete a multi-byte character only with the next one: hold back "\ufffd".
        text = out.text if out.finished else out.text.rstrip("\ufffd")
        shown = self.shown[index]
        if len(text) <= len(shown) or not text.startswith(shown):
            return ""
        self.shown[index] = text
        return text[len(shown) :]


def _sse(chunks: AsyncIterator[BaseModel], run: _Run) -> StreamingResponse:
    return StreamingResponse(_events(chunks, run), media_type="text/event-stream")


async def _events(chunks: AsyncIterator[BaseModel], run: _Run) -> AsyncIterator[str]:
    """``data: {json}`` per chunk, then ``data: [DONE]``; a failure mid-stream is an error event.

    NOTE: a client that disconnects cancels this generator (Starlette listens for the disconnect);
    ``finally`` aborts the engine requests so their blocks are freed at once.
    """
    try:
        async for chunk in chunks:
            yield f"data: {chunk.model_dump_json()}\n\n"
    except APIError as exc:
        yield f"data: {json.dumps(error_body(exc.status, exc.message, exc.code))}\n\n"
    finally:
        run.abort()
    yield "data: [DONE]\n\n"
