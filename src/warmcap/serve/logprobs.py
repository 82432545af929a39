"""The engine's per-token logprobs (``outputs.SampleLogprobs``, as ``LLM.generate`` returns them) in
OpenAI's two shapes: the completions' parallel lists and the chat's per-token objects."""

from __future__ import annotations

from collections.abc import Sequence

from warmcap.outputs import Logprob, SampleLogprobs
from warmcap.serve.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


def completion_logprobs(
    token_ids: Sequence[int], entries: SampleLogprobs, num_top: int, text_offset: int
) -> CompletionLogprobs:
    """Per token: its text, its logprob, and (``num_top`` > 0) every candidate the engine returned,
    the sampled one included, by text. ``text_offset`` is where the first token's text starts in
    the choice's ``text`` (after an echoed prompt, or the text already streamed)."""
    out = CompletionLogprobs()
    offset = text_offset
    for token, entry in zip(token_ids, entries, strict=True):
        chosen = entry[token]
        text = chosen.decoded_token or ""
        out.text_offset.append(offset)
        out.tokens.append(text)
        out.token_logprobs.append(chosen.logprob)
        out.top_logprobs.append(
            {(lp.decoded_token or ""): lp.logprob for lp in entry.values()} if num_top else None
        )
        offset += len(text)
    return out


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
