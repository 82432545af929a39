"""KV memory a Mamba hybrid's request holds at 2k tokens: every column the rule reserves (what
warmcap held before it freed state blocks behind the live state) against the blocks it holds now.

The model is the ``tiny-hybrid`` preset built on the meta device (no weights); block 16, k = 3
draft tokens with a lookahead of 3 (EAGLE/MTP), one request driven through a 2,048-token prefill
and 8 verify steps that accept every draft.

    .venv/bin/python benchmarks/bench_hybrid_memory.py [--tokens 2048]
"""

from __future__ import annotations

import argparse

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.core.kv_cache_manager import KVCacheManager
from warmcap.core.request import Request
from warmcap.kv_layout import build_kv_groups, meta_model
from warmcap.models.presets import resolve_model

K = 3


def measure(mode: str, tokens: int) -> tuple[int, int, int]:
    """(bytes of every reserved column, bytes of the blocks held, Mamba blocks held per group)."""
    config = EngineConfig(
        model=ModelConfig(model="tiny-hybrid", dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=4096, mamba_cache_mode=mode),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=tokens, max_model_len=tokens + 64),
        speculative=SpeculativeConfig.parse(f"eagle:{K}"),
    )
    model, _ = meta_model(resolve_model("tiny-hybrid"), config)
    groups = build_kv_groups(model, config)
    kv = KVCacheManager(groups, 4096, max_model_len=tokens + 64, enable_caching=False)
    req = Request("r", [1] * tokens)
    kv.allocate_slots(req, tokens, num_lookahead_tokens=K)
    req.num_computed_tokens = tokens
    for _ in range(8):
        req.output_token_ids.append(1)
        kv.allocate_slots(req, 1 + K, num_lookahead_tokens=K)  # the bonus token and K drafts
        req.output_token_ids.extend([1] * K)  # every draft accepted
        req.num_computed_tokens += 1 + K
    ids = kv.get_block_ids("r")
    reserved = sum(len(ids[g.name]) * g.page_size_bytes for g in groups)
    held = sum(sum(1 for b in ids[g.name] if b) * g.page_size_bytes for g in groups)
    mamba = [sum(1 for b in ids[g.name] if b) for g in groups if g.spec.kind == "mamba"]
    return reserved, held, mamba[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    print("| mode | reserved columns (before) | held now | ratio | Mamba blocks held per group |")
    print("|---|---|---|---|---|")
    for mode in ("none", "all", "align"):
        reserved, held, mamba = measure(mode, args.tokens)
        print(
            f"| {mode} | {reserved / 1024:.1f} KiB | {held / 1024:.1f} KiB | {reserved / held:.2f}x | {mamba} |"
        )


if __name__ == "__main__":
    main()
