"""Incremental detokenisation (``warmcap.detokenizer``) against the tokenizer's own whole decode.

Oracle: ``tokenizer.decode(ids_so_far, skip_special_tokens=...)`` after every push, for the byte-level
BPE tokenizers the project loads (tiny-llama's, SmolLM2's) and a sentencepiece-style one (Metaspace
spaces, byte fallback, a stripped leading space) trained here, fed random ids that include special
tokens, lone UTF-8 bytes and the pieces of multi-byte characters.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.detokenizer import MAX_PENDING, REPLACEMENT, TextDecoder
from warmcap.models.loader import load_tokenizer
from warmcap.models.presets import resolve_model
from warmcap.models.tiny import CORPUS

#: text whose encoding splits multi-byte characters (2, 3 and 4 bytes) across tokens
MULTILINGUAL = "Café crème, naïve façade; 東京タワー 😀👍🏽 € ½ — “quoted” ok\nß Ω ж"


def sentencepiece_style() -> Any:
    """A Llama-2-style tokenizer: ``▁`` for spaces, ``<0xNN>`` byte fallback for characters outside
    its vocabulary, a decoder that strips the text's leading space. Trained on ASCII only, so every
    non-ASCII character decodes from byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    base.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    data = json.loads(base.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in data["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = base.normalizer
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@functools.cache
def tokenizer(name: str) -> Any:
    if name == "sentencepiece-style":
        return sentencepiece_style()
    return load_tokenizer(resolve_model(name))


@functools.cache
def id_pools(name: str) -> tuple[list[int], list[int], list[int]]:
    """(special ids, ids whose own text is incomplete UTF-8, ids of multilingual text)."""
    tok = tokenizer(name)
    special = sorted(tok._tokenizer.get_added_tokens_decoder())
    partial = [i for i in range(len(tok)) if REPLACEMENT in tok.decode([i])]
    text = tok.encode(MULTILINGUAL, add_special_tokens=False)
    assert partial and special and any(REPLACEMENT in tok.decode([i]) for i in text)
    return special, partial, text


TOKENIZERS = [
    "tiny-llama",
    "sentencepiece-style",
    pytest.param("smollm2-135m", marks=[pytest.mark.real_model, pytest.mark.slow]),
]


@st.composite
def pushes(draw: st.DrawFn, name: str) -> list[list[int]]:
    """Random ids cut into pushes of 1-3: specials, lone bytes, runs of real multilingual text."""
    special, partial, text = id_pools(name)
    vocab = len(tokenizer(name))
    piece = st.one_of(
        st.lists(st.sampled_from(special), min_size=1, max_size=2),
        st.lists(st.sampled_from(partial), min_size=1, max_size=4),
        st.integers(0, len(text) - 1).flatmap(lambda i: st.just(text[i : i + 8])),
        st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3),
    )
    ids = [t for p in draw(st.lists(piece, min_size=1, max_size=12)) for t in p]
    cuts: list[list[int]] = []
    while ids:
        k = draw(st.integers(1, 3))
        cuts.append(ids[:k])
        ids = ids[k:]
    return cuts


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", TOKENIZERS)
def test_pushed_text_equals_the_whole_decode_at_every_step(name: str, skip: bool) -> None:
    tok = tokenizer(name)
    decoder = TextDecoder(tok, skip_special_tokens=skip)

    @settings(max_examples=150, deadline=None)
    @given(pushes(name))
    def check(cuts: list[list[int]]) -> None:
        stream = decoder.stream()
        ids: list[int] = []
        sent = ""
        for cut in cuts:
            ids += cut
            stream.push(cut)
            whole = tok.decode(ids, skip_special_tokens=skip)
            assert stream.num_tokens == len(ids)
            if not whole.endswith(REPLACEMENT):
                # complete text is never held back
                assert (stream.text, stream.tail) == (whole, ""), ids
            if decoder.context_free:
                # the incomplete rest included
                assert stream.full == whole, (ids, stream.text, stream.tail)
                # byte-level text only grows: what a stream sent is never taken back
                assert stream.text.startswith(sent)
                sent = stream.text
                # the held-back ids stay few: an incomplete character is at most 3 more bytes
                assert stream.num_pending <= MAX_PENDING + 3 + len(cut)
        assert stream.final() == tok.decode(ids, skip_special_tokens=skip)

    check()


@pytest.mark.parametrize("skip", [True, False])
def test_a_byte_fallback_space_taken_back_by_an_invalid_byte_reads_as_the_whole_decode(skip: bool) -> None:
    """Found by the property above: a byte-fallback space (committed: complete text) then a lone
    continuation byte, which turns the whole byte run into U+FFFD. Decoded alone the space's token
    reads as "" (the decoder drops a leading space), so only a window read mid-text sees that."""
    tok = tokenizer("sentencepiece-style")
    space, invalid = tok.convert_tokens_to_ids(["<0x20>", "<0x80>"])
    stream = TextDecoder(tok, skip_special_tokens=skip).stream()
    ids: list[int] = []
    for cut in ([tok.unk_token_id], [space], [invalid], [tok.unk_token_id]):
        ids += cut
        stream.push(cut)
        whole = tok.decode(ids, skip_special_tokens=skip)
        if not whole.endswith(REPLACEMENT):
            assert (stream.text, stream.tail) == (whole, "")
    assert stream.final() == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_push_decodes_a_window_not_the_whole_output(name: str) -> None:
    """Pushing ordinary text token by token decodes a few ids per push however long the text."""
    tok = tokenizer(name)
    decoder = TextDecoder(tok, skip_special_tokens=True)
    ids = tok.encode((MULTILINGUAL + " " + CORPUS) * 3, add_special_tokens=False)
    stream = decoder.stream()
    per_push = []
    for i, t in enumerate(ids):
        before = decoder.tokens_decoded
        stream.push([t])
        per_push.append(decoder.tokens_decoded - before)
        if i % 97 == 0:
            assert stream.full == tok.decode(ids[: i + 1], skip_special_tokens=True)
    assert stream.full == tok.decode(ids, skip_special_tokens=True)
    assert len(ids) > 600
    # an emoji is 4 byte tokens at most, each re-read with its context; a decoder that needs
    # context decodes the window and the next context each after one anchor token
    anchor = 0 if decoder.context_free else 1
    assert max(per_push) <= 2 * (6 + anchor), per_push


def test_a_tokenizer_that_cleans_up_spaces_decodes_whole_and_stays_exact() -> None:
    """transformers' clean-up rewrites " ." across token boundaries: such a tokenizer is decoded
    whole at every push (exact, not windowed)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer("sentencepiece-style")._tokenizer,
        clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True,
    )
    ids = tok.encode("Stop . Go , now ? yes ! it 's done .", add_special_tokens=False)
    decoder = TextDecoder(tok, skip_special_tokens=True)
    assert not decoder.local
    stream = decoder.stream()
    for i, t in enumerate(ids):
        stream.push([t])
        assert stream.full == tok.decode(ids[: i + 1], skip_special_tokens=True)
    assert stream.full == "Stop. Go, now? yes! it's done."


def test_no_tokenizer_decodes_to_nothing() -> None:
    decoder = TextDecoder(None)
    stream = decoder.stream()
    stream.push([5, 6, 7])
    assert (decoder([1, 2]), stream.full, stream.num_tokens) == ("", "", 3)
