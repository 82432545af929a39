"""What one streamed choice may send next: new text (less any tail that may still turn into a stop
string, or an unfinished multi-byte character), the tokens and logprobs since the last chunk."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from warmcap.outputs import RequestOutput, SampleLogprobs


def undecided_tail(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is the start of a stop string: the next tokens
    may complete the stop string, and the engine then cuts the text before it, so it is not sent yet."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


@dataclass(slots=True)
class Sent:
    """One choice's stream so far. ``prefix`` (an echoed prompt) goes out with the first text."""

    prefix: str = ""
    text: str = ""
    num_tokens: int = 0
    #: where the next token's text starts in the choice's text (completions' ``text_offset``)
    offset: int = 0

    def advance(
        self, out: RequestOutput, stops: Sequence[str]
    ) -> tuple[str, list[int], SampleLogprobs | None] | None:
        """``(text, token_ids, logprobs)`` to send for ``out``, or None while nothing can be sent
        (a finished output always sends, if only its finish reason). Tokens and logprobs that
        arrive while their text is held back go out with the next chunk."""
        c = out.outputs[0]
        text = c.text
        if not out.finished:
            # A token may complete a multi-byte character only with the next one.
            text = text.rstrip("\ufffd")
            text = text[: len(text) - undecided_tail(text, stops)]
        text = self.prefix + text
        new = text[len(self.text) :] if len(text) > len(self.text) and text.startswith(self.text) else ""
        if not new and not out.finished:
            return None
        self.text += new
        token_ids = c.token_ids[self.num_tokens :]
        logprobs = None if c.logprobs is None else c.logprobs[self.num_tokens :]
        self.num_tokens = len(c.token_ids)
        return new, token_ids, logprobs
