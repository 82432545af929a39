"""Prompts as vLLM accepts them (text, token ids, ``{"prompt": ...}``, ``{"prompt_token_ids": ...}``),
checked before anything is queued."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

from warmcap.errors import ConfigError

#: A text, a list of token ids, or a vLLM-style dict with ``prompt`` or ``prompt_token_ids``.
PromptType = str | Sequence[int] | Mapping[str, Any]

_DICT_KEYS = ("prompt", "prompt_token_ids")


def split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    """``(text, token_ids)`` of a prompt; token ids win when a dict gives both (as in vLLM)."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Mapping):
        unknown = sorted(set(prompt) - set(_DICT_KEYS))
        if unknown or not any(k in prompt for k in _DICT_KEYS):
            raise ConfigError(
                f"a dict prompt needs 'prompt' (text) or 'prompt_token_ids' (a list of ids); got keys "
                f"{sorted(prompt)}"
            )
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ConfigError(f"'prompt' must be a string; got {type(text).__name__}")
        ids = prompt.get("prompt_token_ids")
        return text, None if ids is None else _as_ids(ids)
    return None, _as_ids(prompt)


def _as_ids(ids: object) -> list[int]:
    if isinstance(ids, (str, bytes)) or (not isinstance(ids, Sequence) and not hasattr(ids, "tolist")):
        raise ConfigError(f"prompt token ids must be a list of integers; got {type(ids).__name__}")
    values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    out = []
    for i, t in enumerate(values):
        # NOTE: bool is an int subclass and float ids truncate silently; neither is a token id.
        if isinstance(t, bool):
            raise ConfigError(f"prompt token id at position {i} is {t!r}, not an integer token id")
        try:
            out.append(operator.index(t))
        except TypeError:
            raise ConfigError(
                f"prompt token id at position {i} is {t!r} ({type(t).__name__}), not an integer"
            ) from None
    return out


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise when an id lies outside ``[0, vocab_size)``: the embedding lookup would fail inside
    the forward, with the request half-scheduled."""
    bad = [(i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab_size]
    if bad:
        i, t = bad[0]
        raise ConfigError(
            f"prompt token id {t} at position {i} is outside the model's vocabulary [0, {vocab_size})"
            + (f" ({len(bad)} ids in all)" if len(bad) > 1 else "")
            + "; pass ids from this model's tokenizer"
        )


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids as ``transformers`` and vLLM encode a text prompt: with the tokenizer's own special
    tokens (its BOS policy), and exactly one BOS when the text already starts with it (a chat
    template rendered to text)."""
    ids = list(tokenizer.encode(text, add_special_tokens=True))
    bos = getattr(tokenizer, "bos_token_id", None)
    bos_text = getattr(tokenizer, "bos_token", None)
    if bos is not None and bos_text and text.startswith(bos_text) and ids[:2] == [bos, bos]:
        ids = ids[1:]
    return ids


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """The token ids of ``messages`` through the tokenizer's chat template, ready to generate from.

    The template writes BOS itself when the model wants one; tokenizing it adds no second one."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
