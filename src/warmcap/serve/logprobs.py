"""The engine's logprobs (``outputs.SampleLogprobs`` and ``outputs.PromptLogprobs``, as
``LLM.generate`` returns them) in the shapes vLLM's OpenAI server gives: the completions' parallel
lists, the chat's per-token objects, and the ``prompt_logprobs`` field."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from warmcap.outputs import Logprob, PromptLogprobs, SampleLogprobs
from warmcap.serve.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    LogprobEntry,
    PromptLogprobsBody,
    TokenLogprob,
    TopLogprob,
)

#: what vLLM's server sends for a log-probability of -inf (JSON has no infinity)
FLOOR = -9999.0


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob] | None],
    num_top: int,
    text_offset: int,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> CompletionLogprobs:
    """Per token: its text, its logprob, and its entry's candidates by text (the token's own first,
    then the ``num_top`` most likely, as vLLM lists them). ``text_offset`` is where the first
    token's text starts; each next one starts where the previous token's text ends. A None entry
    (an echoed prompt's first token) gives a null logprob and null candidates, its text from
    ``decode``."""
    out = CompletionLogprobs()
    offset = text_offset
    for token, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            text = decode([token]) if decode is not None else ""
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            chosen = entry[token]
            text = chosen.decoded_token or ""
            out.token_logprobs.append(max(chosen.logprob, FLOOR))
            candidates = list(entry.values())[: num_top + 1]
            out.top_logprobs.append({(lp.decoded_token or ""): max(lp.logprob, FLOOR) for lp in candidates})
        out.text_offset.append(offset)
        out.tokens.append(text)
        offset += len(text)
    return out


def prompt_logprobs_body(entries: PromptLogprobs | None) -> PromptLogprobsBody | None:
    """``RequestOutput.prompt_logprobs`` as vLLM's server sends it (-inf floored)."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            tid: LogprobEntry(logprob=max(lp.logprob, FLOOR), rank=lp.rank, decoded_token=lp.decoded_token)
            for tid, lp in entry.items()
        }
        for entry in entries
    ]


def chat_logprobs(token_ids: Sequence[int], entries: SampleLogprobs, num_top: int) -> ChatLogprobs:
    """Per token: its text, logprob and UTF-8 bytes, and the ``num_top`` most likely candidates in
    rank order."""
    content = []
    for token, entry in zip(token_ids, entries, strict=True):
        top = sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
        content.append(
            TokenLogprob(**_top(entry[token]).model_dump(), top_logprobs=[_top(lp) for lp in top[:num_top]])
        )
    return ChatLogprobs(content=content)


def _top(lp: Logprob) -> TopLogprob:
    text = lp.decoded_token or ""
    return TopLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode("utf-8")))
