"""Chained hashes of full token blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, so equal hashes mean equal whole prefixes. sha256 over a
fixed binary encoding keeps hashes identical across processes and Python hash seeds.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

_HASH_BYTES = 16
ROOT_HASH = 0


# Packers of n little-endian int64s by n: the bytes ``array("q", ...)`` gives on every machine we
# run on, built without the array's per-item conversion (this runs for every block that fills).
_PACKERS: dict[int, Callable[..., bytes]] = {}


def _new_packer(num_ints: int) -> Callable[..., bytes]:
    pack = _PACKERS[num_ints] = struct.Struct(f"<{num_ints}q").pack
    return pack


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int], extra: Sequence[int] = ()) -> int:
    """Hash of one full block: ``(parent_hash, token_ids, extra)`` -> a 128-bit int.

    ``extra`` carries anything besides tokens that changes the KV (none today; e.g. an adapter id).
    """
    # Blocks in one cache key space all have the same size, so the token bytes need no length.
    pack = _PACKERS.get(len(token_ids)) or _new_packer(len(token_ids))
    data = parent_hash.to_bytes(_HASH_BYTES, "little") + pack(*token_ids)
    if extra:
        data += b"|" + (_PACKERS.get(len(extra)) or _new_packer(len(extra)))(*extra)
    return int.from_bytes(hashlib.sha256(data).digest()[:_HASH_BYTES], "little")


def extend_block_hashes(
    block_hashes: list[int], prompt: Sequence[int], output: Sequence[int], block_size: int
) -> None:
    """Append hashes for the full blocks of ``prompt + output`` not hashed yet.

    Reads the two lists in place instead of concatenating them: a concatenation would cost the
    whole sequence length each time a block fills. Blocks already hashed are never hashed again.
    """
    num_prompt = len(prompt)
    num_full = (num_prompt + len(output)) // block_size
    index = len(block_hashes)
    if index >= num_full:
        return
    parent = block_hashes[-1] if index else ROOT_HASH
    start = index * block_size
    for end in range(start + block_size, num_full * block_size + 1, block_size):
        if end <= num_prompt:
            tokens = prompt[start:end]
        elif start >= num_prompt:
            tokens = output[start - num_prompt : end - num_prompt]
        else:
            tokens = [*prompt[start:], *output[: end - num_prompt]]
        parent = hash_block_tokens(parent, tokens)
        block_hashes.append(parent)
        start = end
