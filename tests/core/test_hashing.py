from __future__ import annotations

import hashlib
import os
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.core.hashing import ROOT_HASH, extend_block_hashes, hash_block_tokens


def test_hash_depends_on_parent_tokens_and_extra():
    base = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert base == hash_block_tokens(ROOT_HASH, (1, 2, 3, 4))
    assert base != hash_block_tokens(ROOT_HASH, [1, 2, 3, 5])
    assert base != hash_block_tokens(base, [1, 2, 3, 4])
    assert base != hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], extra=[9])


def test_hash_is_stable_across_processes():
    code = "from warmcap.core.hashing import hash_block_tokens as h; print(h(0, [5, 6, 7]))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": s},
        ).stdout
        for s in ("1", "2")
    }
    assert runs == {f"{hash_block_tokens(0, [5, 6, 7])}\n"}


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 100), max_size=40),
    output=st.lists(st.integers(0, 100), max_size=40),
    split=st.integers(0, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
)
def test_incremental_hashes_equal_hashing_the_whole_sequence(prompt, output, split, block_size):
    tokens = prompt + output
    reference: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tokens[start : start + block_size])
        reference.append(parent)
    hashes: list[int] = []
    # Hash as the output grows, in two steps, reading prompt and output separately.
    extend_block_hashes(hashes, prompt, output[: min(split, len(output))], block_size)
    extend_block_hashes(hashes, prompt, output, block_size)
    assert hashes == reference


@settings(max_examples=200, deadline=None)
@given(
    parent=st.integers(0, 2**128 - 1),
    tokens=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=32),
    extra=st.lists(st.integers(0, 2**31), max_size=3),
)
def test_hash_is_sha256_of_the_documented_encoding(parent, tokens, extra):
    # Cached hashes must not drift between versions: 16-byte little-endian parent, int64 tokens,
    # then "|" and int64 extras, sha256, first 16 bytes little-endian.
    def int64s(values: list[int]) -> bytes:
        return b"".join(v.to_bytes(8, "little", signed=True) for v in values)

    data = parent.to_bytes(16, "little") + int64s(tokens)
    if extra:
        data += b"|" + int64s(extra)
    expected = int.from_bytes(hashlib.sha256(data).digest()[:16], "little")
    assert hash_block_tokens(parent, tokens, extra) == expected
