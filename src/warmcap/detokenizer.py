"""Token ids to text, a few new tokens at a time, equal to decoding the whole output at once.

Decoding a request's whole output every step costs work that grows with its length (and with the
square of it over the request). :class:`TextStream` instead decodes only a small window: the tokens
since the text was last complete, plus (for decoders whose output for a token depends on its
neighbours) the tokens committed just before them, whose text is known and is cut off again. It is
the prefix/read-offset mechanism of vLLM's and ``tokenizers``' incremental decoders:

* a window's text that ends in U+FFFD may be a multi-byte character split across tokens, so it is
  held back (``tail``) and decoded again with the next token;
* skipped special tokens are dropped before decoding, as the tokenizer itself drops them;
* byte-level BPE (GPT-2, SmolLM2) needs no context: its decode is the lossy UTF-8 reading of the
  tokens' bytes, and that reading starts afresh after every complete character.

A tokenizer whose decode cannot be cut this way (a post-processing clean-up of spaces, a tokenizer
without the Rust backend) gets exact text by decoding everything, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

#: what a decoder writes for bytes that are not (yet) a whole UTF-8 character
REPLACEMENT = "\ufffd"
#: Tokens a window may hold back while its text still ends in U+FFFD before a split is looked for.
#: A real character spans at most 4 bytes, so only invalid bytes (or a literal U+FFFD) reach it.
MAX_PENDING = 8


class TextDecoder:
    """A tokenizer's ``decode(ids, skip_special_tokens=...)`` with fixed options, and the per-request
    :class:`TextStream` built on it. ``tokens_decoded`` counts every token id handed to the tokenizer.

    ``tokenizer`` None (a model without one) decodes everything to "".
    """

    __slots__ = (
        "_anchor",
        "_anchor_text",
        "_raw",
        "context_free",
        "local",
        "skip_special_tokens",
        "skipped",
        "tokenizer",
        "tokens_decoded",
    )

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens_decoded = 0
        backend = _plain_backend(tokenizer)
        #: the window may be cut anywhere the text so far is complete (see the module docstring)
        self.local = backend is not None
        #: a token's text does not depend on the tokens before it (byte-level BPE)
        self.context_free = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
        #: ids the tokenizer drops before decoding
        self.skipped: frozenset[int] = frozenset()
        if backend is not None and skip_special_tokens:
            added = backend.get_added_tokens_decoder()
            self.skipped = frozenset(i for i, tok in added.items() if tok.special)
        # A plain token decoded before ids that do not start the text, then cut off: they read as
        # they do mid-text (a Metaspace decoder drops the first token's leading space, and a
        # byte-fallback run's text is only seen whole after something else).
        self._anchor: list[int] = []
        self._anchor_text = ""
        if backend is not None and not self.context_free:
            anchor = backend.encode("a", add_special_tokens=False).ids[-1:]
            text = backend.decode(anchor, skip_special_tokens=skip_special_tokens)
            if anchor and text and REPLACEMENT not in text:
                self._anchor, self._anchor_text = anchor, text
        self._raw: Callable[[Sequence[int]], str]
        if tokenizer is None:
            self._raw = lambda ids: ""
        elif backend is not None:
            # The Rust decode is what the tokenizer's own decode returns (checked in _plain_backend),
            # without transformers' per-call overhead (~5x on a short window).
            self._raw = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        else:
            self._raw = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __call__(self, token_ids: Sequence[int]) -> str:
        """``token_ids`` decoded whole: exactly the tokenizer's ``decode`` with these options."""
        self.tokens_decoded += len(token_ids)
        return self._raw(token_ids)

    def after_text(self, token_ids: Sequence[int]) -> str | None:
        """``token_ids``' text as it reads after earlier text (None: it cannot be told apart)."""
        if not self._anchor:
            return self(token_ids)
        text = self([*self._anchor, *token_ids])
        return text[len(self._anchor_text) :] if text.startswith(self._anchor_text) else None

    def stream(self) -> TextStream:
        """A new, empty per-request stream."""
        return TextStream(self)


def _plain_backend(tokenizer: Any) -> Any:
    """The ``tokenizers`` backend when the tokenizer's decode is just the backend's decode (a
    transformers fast tokenizer that does not override ``_decode`` and cleans up no spaces), else None.

    NOTE: transformers' clean-up (" ." -> ".", " 's" -> "'s", ...) rewrites text across token
    boundaries, so a window's text would not be the whole text's; such tokenizers decode whole.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
        return None
    try:
        from transformers import TokenizersBackend
    except ImportError:  # transformers < 5 calls the same class PreTrainedTokenizerFast
        from transformers import PreTrainedTokenizerFast as TokenizersBackend
    if (
        not isinstance(tokenizer, TokenizersBackend)
        or type(tokenizer)._decode is not TokenizersBackend._decode
    ):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        bpe = type(backend.model).__name__ == "BPE"
        if not bpe or getattr(
            tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
        ):
            return None
    return backend


class TextStream:
    """One request's output text, fed its token ids as they are generated.

    After every :meth:`push` whose whole decode is complete (does not end in U+FFFD), ``text`` is
    exactly the decoder's decode of all the ids pushed so far and ``tail`` is empty; otherwise ``text``
    is the complete part and ``tail`` (:attr:`full` = ``text + tail``) the held-back rest, ending in
    U+FFFD. For byte-level BPE ``full`` is the whole decode after every push, and ``text`` only grows.
    Each push decodes only the window (the ids of that push, those held back, and for decoders that
    need context the previous push's), never the whole output.
    """

    __slots__ = (
        "_all",
        "_context",
        "_dec",
        "_mid",
        "_num_context",
        "_whole",
        "_window",
        "num_tokens",
        "tail",
        "text",
    )

    def __init__(self, decoder: TextDecoder) -> None:
        self._dec = decoder
        self.text = ""
        self.tail = ""
        #: token ids pushed so far
        self.num_tokens = 0
        #: kept ids from the window start: the context (already in ``text``) then the held-back ids
        self._window: list[int] = []
        self._num_context = 0
        #: the context ids' own decode, cut off the window's text
        self._context = ""
        #: the window no longer starts the text: decode it as it reads mid-text
        self._mid = False
        #: every id pushed, where the stream may have to decode them whole (all but byte-level BPE)
        self._all: list[int] | None = None if decoder.context_free else []
        #: decode everything each push: a decoder that is not local, or a window that stopped reading
        #: as its start did
        self._whole = not decoder.local

    @property
    def full(self) -> str:
        """The decode of every id pushed so far (a character still incomplete at the end included)."""
        return self.text + self.tail if self.tail else self.text

    def final(self) -> str:
        """The decode of every id pushed, exactly, for a request that ended: :attr:`full`, or where
        a byte-fallback run was left incomplete (its text is then U+FFFD throughout), a whole decode."""
        if not self.tail or self._all is None:
            return self.full
        return self._dec(self._all)

    @property
    def num_pending(self) -> int:
        """Ids pushed whose text is held back (an incomplete character at the end)."""
        return 0 if self._whole else len(self._window) - self._num_context

    def push(self, token_ids: Sequence[int]) -> None:
        """Add ``token_ids`` (the next generated ids) to the text."""
        dec = self._dec
        self.num_tokens += len(token_ids)
        if self._all is not None:
            self._all.extend(token_ids)
            if self._whole:
                self.text, self.tail = _split_incomplete(dec(self._all))
                return
        kept = [t for t in token_ids if t not in dec.skipped] if dec.skipped else token_ids
        if not kept:
            return
        window = self._window
        window.extend(kept)
        text = dec.after_text(window) if self._mid else dec(window)
        if text is None:
            self._go_whole()
            return
        context = self._context
        if text.endswith(REPLACEMENT):
            # NOTE: with sentencepiece's byte fallback, an incomplete character turns its whole run of
            # byte tokens into U+FFFD, the context's included, until it completes: only a marker is
            # kept then (the text a stream may send stops before it either way).
            self.tail = text[len(context) :] if text.startswith(context) else REPLACEMENT
            if len(window) - self._num_context > MAX_PENDING and dec.context_free:
                self._split_pending(text)
            return
        if not text.startswith(context):
            # The context reads differently for good: a run of byte-fallback tokens with an invalid
            # byte reads as U+FFFD throughout, text already committed included. Decode whole from now.
            self._go_whole()
            return
        self.text += text[len(context) :]
        self.tail = ""
        self._commit(len(window))

    def _go_whole(self) -> None:
        self._whole = True
        assert self._all is not None  # a context is kept only where every id is
        self.text, self.tail = _split_incomplete(self._dec(self._all))

    def _commit(self, end: int) -> None:
        """Ids ``window[:end]`` are in ``text`` now; the next window starts after them, or (for a
        decoder that needs context) at the first of the ids just committed."""
        window = self._window
        if self._dec.context_free:
            del window[:end]
            self._num_context, self._context = 0, ""
            return
        if self._num_context:
            del window[: self._num_context]
            self._mid = True
        end -= self._num_context
        self._num_context = end
        context = self._dec.after_text(window[:end]) if self._mid else self._dec(window[:end])
        if context is None:
            self._go_whole()
            return
        self._context = context

    def _split_pending(self, text: str) -> None:
        """Commit held-back ids up to the last one after which the bytes read afresh (the pending
        text ends in a U+FFFD that no later token can change: invalid bytes or a literal U+FFFD).

        A split point ``j`` is one where decoding ``window[:j]`` and ``window[j:]`` apart gives the
        window's text: a character or an invalid byte run straddling ``j`` would read differently.
        An incomplete character at the end spans at most 3 bytes, so at most 3 ids (each at least a
        byte) are looked past.
        """
        dec = self._dec
        window = self._window
        for j in range(len(window) - 1, max(0, len(window) - 4), -1):
            head = dec(window[:j])
            rest = dec(window[j:])
            if head + rest == text:
                self.text += head
                self.tail = rest
                self._commit(j)
                return


def _split_incomplete(text: str) -> tuple[str, str]:
    """``text`` as (what is complete, a trailing run of U+FFFD that the next ids may complete)."""
    stripped = text.rstrip(REPLACEMENT)
    return stripped, text[len(stripped) :]
