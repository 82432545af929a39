"""An OpenAI request body -> the :class:`SamplingParams` ``LLM.generate`` takes, and the prompts.

Every field a request may carry is either honoured here or refused with a 400 naming it; nothing is
accepted and dropped.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from warmcap.errors import ConfigError
from warmcap.sampling_params import SamplingParams
from warmcap.serve.errors import APIError
from warmcap.serve.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

#: OpenAI's default for completions when ``max_tokens`` is not given.
DEFAULT_COMPLETION_TOKENS = 16
#: most ``logprobs`` / ``top_logprobs`` one request may ask for (vLLM's default ``max_logprobs``)
MAX_LOGPROBS = 20


def refuse_unknown_fields(body: BaseModel, where: str = "") -> None:
    """A 400 naming the first field this server does not implement (a null one is as if absent)."""
    extra = {k: v for k, v in (body.model_extra or {}).items() if v is not None}
    if extra:
        names = ", ".join(sorted(f"{where}{k}" for k in extra))
        raise APIError(
            400,
            f"unsupported parameter(s) {names}: this server does not implement them (it would ignore "
            "them); remove them from the request",
            "unsupported_parameter",
            f"{where}{min(extra)}",
        )


def completion_params(body: CompletionRequest) -> SamplingParams:
    """With ``echo`` and ``logprobs`` the prompt's own logprobs are computed too (as vLLM: the
    ``logprobs`` count unless ``prompt_logprobs`` names one). ``max_tokens: 0`` is allowed only with
    ``echo``: the engine runs one token, which the handler drops (``echo_only``), as vLLM does."""
    refuse_unknown_fields(body)
    _check_logprobs("logprobs", body.logprobs)
    _check_logprobs("prompt_logprobs", body.prompt_logprobs)
    max_tokens = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
    if echo_only(body):
        max_tokens = 1
    elif max_tokens == 0:
        raise APIError(
            400,
            "max_tokens must be an integer >= 1; got 0 (0 is allowed only with echo=true, which returns "
            "just the prompt): give max_tokens >= 1 or set echo",
            "invalid_parameter",
            "max_tokens",
        )
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and body.echo:
        prompt_logprobs = body.logprobs
    return _params(body, max_tokens, body.logprobs, prompt_logprobs)


def echo_only(body: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens: 0``: the answer is the prompt (and its logprobs), nothing generated."""
    return body.echo and body.max_tokens == 0


def chat_params(body: ChatCompletionRequest, default_max_tokens: int) -> SamplingParams:
    """``default_max_tokens`` applies when the request names no limit (the engine loop replaces it
    with what the context leaves once the prompt is known)."""
    refuse_unknown_fields(body)
    for i, message in enumerate(body.messages):
        refuse_unknown_fields(message, f"messages[{i}].")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(
            400,
            f"top_logprobs={body.top_logprobs} needs logprobs=true: set both, or drop top_logprobs",
            "invalid_parameter",
            "top_logprobs",
        )
    _check_logprobs("top_logprobs", body.top_logprobs)
    limit = next((n for n in (body.max_completion_tokens, body.max_tokens) if n is not None), None)
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    _check_logprobs("prompt_logprobs", body.prompt_logprobs)
    return _params(body, default_max_tokens if limit is None else limit, num_top, body.prompt_logprobs)


def _check_logprobs(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(
            400,
            f"{name} must be an integer in [0, {MAX_LOGPROBS}]; got {value}",
            "invalid_parameter",
            name,
        )


def _params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    given = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "repetition_penalty": body.repetition_penalty,
    }
    kwargs: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    kwargs.update(
        seed=body.seed,
        n=body.n,
        max_tokens=max_tokens,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or ()),
        stop_token_ids=list(body.stop_token_ids or ()),
    )
    try:
        return SamplingParams(**kwargs)
    except ConfigError as exc:
        raise APIError(400, str(exc), "invalid_parameter", _named_param(str(exc), kwargs)) from None


def _named_param(message: str, kwargs: dict[str, Any]) -> str | None:
    return next((k for k in kwargs if message.startswith(k)), None)


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """One engine prompt per prompt of the request (a list of ids is one prompt)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(
            400, "empty prompt: give a string, token ids, or a list of either", "invalid_prompt", "prompt"
        )
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def chat_messages(messages: list[ChatMessage]) -> tuple[tuple[str, str, str | None], ...]:
    """``(role, text, name)`` per message; a list of text parts is joined with newlines (as vLLM
    joins them); a part of any other type is refused."""
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type")
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400,
                        f"messages[{i}].content[{j}] has type {kind!r}: this server serves a text model "
                        'and takes only {"type": "text", "text": "..."} parts',
                        "unsupported_parameter",
                        f"messages[{i}].content",
                    )
                unknown = sorted(set(part) - {"type", "text"})
                if unknown:
                    raise APIError(
                        400,
                        f"messages[{i}].content[{j}] has unsupported field(s) {unknown}: send type and text only",
                        "unsupported_parameter",
                        f"messages[{i}].content",
                    )
                texts.append(part["text"])
            text = "\n".join(texts)
        out.append((message.role, text, message.name))
    return tuple(out)
