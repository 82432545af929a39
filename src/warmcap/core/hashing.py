"""Chained hashes of full token blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, so equal hashes mean equal whole prefixes. sha256 over a
fixed binary encoding keeps hashes identical across processes and Python hash seeds.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_HASH_BYTES = 16
ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int], extra: Sequence[int] = ()) -> int:
    """Hash of one full block: ``(parent_hash, token_ids, extra)`` -> a 128-bit int.

    ``extra`` carries anything besides tokens that changes the KV (none today; e.g. an adapter id).
    """
    # Blocks in one cache key space all have the same size, so the token bytes need no length.
    data = parent_hash.to_bytes(_HASH_BYTES, "little") + array("q", token_ids).tobytes()
    if extra:
        data += b"|" + array("q", extra).tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:_HASH_BYTES], "little")


def extend_block_hashes(
    block_hashes: list[int], prompt: Sequence[int], output: Sequence[int], block_size: int
) -> None:
    """Append hashes for the full blocks of ``prompt + output`` not hashed yet.

    Reads the two lists in place instead of concatenating them: this runs every step for every
    request, and a concatenation would cost the whole sequence length each time.
    """
    num_prompt = len(prompt)
    num_full = (num_prompt + len(output)) // block_size
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    for index in range(len(block_hashes), num_full):
        start, end = index * block_size, (index + 1) * block_size
        if end <= num_prompt:
            tokens = prompt[start:end]
        elif start >= num_prompt:
            tokens = output[start - num_prompt : end - num_prompt]
        else:
            tokens = list(prompt[start:]) + list(output[: end - num_prompt])
        parent = hash_block_tokens(parent, tokens)
        block_hashes.append(parent)
