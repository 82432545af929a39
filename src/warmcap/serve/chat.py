"""Chat messages -> prompt token ids through the model's chat template."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from warmcap.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation to render with the chat template (in the engine thread, which owns the tokenizer)."""

    #: ``(role, content, name)``; ``name`` None when the message has none
    messages: tuple[tuple[str, str, str | None], ...]


#: arguments of ``apply_chat_template`` the caller sets itself, never taken from template kwargs
_TEMPLATE_OWN = frozenset({"conversation", "tokenize", "add_generation_prompt", "continue_final_message"})


def chat_token_ids(
    tokenizer: Any, messages: Sequence[tuple[str, str] | tuple[str, str, str | None]], model: str
) -> list[int]:
    """Render ``(role, content)`` or ``(role, content, name)`` messages with the template and encode
    the text as is.

    NOTE: the template writes any BOS itself, so the text is encoded without special tokens;
    encoding with them would give a second BOS.
    """
    text = chat_text(tokenizer, messages, model)
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_text(
    tokenizer: Any,
    messages: Sequence[tuple[str, str] | tuple[str, str, str | None]],
    model: str,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation rendered by the model's chat template (what ``/tokenize`` encodes too)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"model {model!r} has no chat template: use /v1/completions with a plain prompt")
    # The request's own fields win over the same names in ``template_kwargs`` (as in vLLM).
    extra = {k: v for k, v in (template_kwargs or {}).items() if k not in _TEMPLATE_OWN}
    if continue_final_message:
        extra["continue_final_message"] = True
    return tokenizer.apply_chat_template(
        [_message(*m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **extra,
    )


def _message(role: str, content: str, name: str | None = None) -> dict[str, str]:
    return (
        {"role": role, "content": content}
        if name is None
        else {"role": role, "content": content, "name": name}
    )
