"""What the server says about its model and tokenizer, as vLLM's server says it: ``GET /v1/models``
(with ``root``, the folder the tokenizer loads from), ``POST /tokenize`` and ``POST /detokenize``.

The tokenizer routes encode as the engine does: ``/tokenize`` of a prompt gives the ids
``/v1/completions`` computes for it, and of chat messages the ids ``/v1/chat/completions`` computes.
They run on the HTTP side, on a copy of the engine's tokenizer: the engine thread keeps using its
own (a ``tokenizers`` object refuses being used from two threads at once when one changes its
settings).
"""

from __future__ import annotations

import asyncio
import copy
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from warmcap.errors import ConfigError
from warmcap.prompts import encode_text
from warmcap.serve.chat import chat_text
from warmcap.serve.errors import APIError
from warmcap.serve.params import chat_messages, refuse_unknown_fields
from warmcap.serve.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

if TYPE_CHECKING:
    from warmcap.serve.state import ServerState

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.warmcap
    state.check_ready()
    engine = state.loop.engine
    card = ModelCard(id=state.model_name, root=str(engine.model_path), max_model_len=state.max_model_len)
    return ModelList(data=[card]).model_dump()


@router.post("/tokenize")
async def tokenize(request: Request, body: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
    """A text ``prompt`` or chat ``messages`` -> ``tokens``, their ``count``, ``max_model_len`` and,
    with ``return_token_strs``, each token's string."""
    state: ServerState = request.app.state.warmcap
    req: TokenizeCompletionRequest | TokenizeChatRequest
    if "messages" in body:
        req = _validated(TokenizeChatRequest, body)
    else:
        req = _validated(TokenizeCompletionRequest, body)
    refuse_unknown_fields(req)
    tokenizer = await _tokenizer(state, req.model)
    if isinstance(req, TokenizeChatRequest):
        for i, message in enumerate(req.messages):
            refuse_unknown_fields(message, f"messages[{i}].")
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(
                400,
                "continue_final_message and add_generation_prompt are both true: the last message is "
                "either continued or answered; set add_generation_prompt to false",
                "invalid_parameter",
                "continue_final_message",
            )
        try:
            text = chat_text(
                tokenizer,
                chat_messages(req.messages),
                state.model_name,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                template_kwargs=req.chat_template_kwargs,
            )
        except ConfigError as exc:
            raise APIError(400, str(exc), "invalid_request", "messages") from None
        except Exception as exc:  # the template's own error (jinja), e.g. a role it does not know
            raise APIError(
                400, f"the chat template refused the messages: {exc}", "invalid_request", "messages"
            ) from None
        tokens = list(tokenizer.encode(text, add_special_tokens=req.add_special_tokens))
        where = "messages"
    else:
        tokens = (
            encode_text(tokenizer, req.prompt)
            if req.add_special_tokens
            else list(tokenizer.encode(req.prompt, add_special_tokens=False))
        )
        where = "prompt"
    _check_length(len(tokens), state.max_model_len, where)
    strs = list(tokenizer.convert_ids_to_tokens(tokens)) if req.return_token_strs else None
    return TokenizeResponse(
        count=len(tokens), max_model_len=state.max_model_len, tokens=tokens, token_strs=strs
    ).model_dump()


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    """``tokens`` -> the text they decode to (special tokens kept, as vLLM decodes them here)."""
    state: ServerState = request.app.state.warmcap
    refuse_unknown_fields(body)
    tokenizer = await _tokenizer(state, body.model)
    vocab = len(tokenizer)
    bad = [(i, t) for i, t in enumerate(body.tokens) if not 0 <= t < vocab]
    if bad:
        i, t = bad[0]
        raise APIError(
            400,
            f"token id {t} at position {i} is outside the tokenizer's vocabulary [0, {vocab})"
            + (f" ({len(bad)} ids in all)" if len(bad) > 1 else "")
            + "; send ids this model's tokenizer produces",
            "invalid_parameter",
            "tokens",
        )
    _check_length(len(body.tokens), state.max_model_len, "tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens)).model_dump()


def _validated(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """``body`` as ``model``; a failure is the server's usual 400 for a malformed body."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()]
        raise RequestValidationError(errors) from None


def _check_length(count: int, max_model_len: int, param: str) -> None:
    # vLLM's tokenizer routes hold a text to the context limit as its generation routes do.
    if count > max_model_len:
        raise APIError(
            400,
            f"{param} has {count} tokens, more than this model's max_model_len {max_model_len}: shorten it",
            "invalid_parameter",
            param,
        )


async def _tokenizer(state: ServerState, model: str | None) -> Any:
    """The HTTP side's copy of the engine's tokenizer (made once, off the event loop)."""
    state.check_ready()
    if model is not None:
        state.check_model(model)
    engine = state.loop.engine
    if engine.tokenizer is None:
        raise APIError(
            400,
            f"model {state.model_name!r} has no tokenizer ({engine.model_path} holds no tokenizer files): "
            "send and read token ids instead",
            "invalid_request",
        )
    if state.tokenizer is None:
        async with state.tokenizer_lock:
            if state.tokenizer is None:
                state.tokenizer = await asyncio.to_thread(copy.deepcopy, engine.tokenizer)
    return state.tokenizer
