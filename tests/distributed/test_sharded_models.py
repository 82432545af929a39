"""Tensor-parallel model shards on CPU with gloo: TP=2 equals TP=1, each rank holds its slice.

Each rank runs in its own spawned process (``warmcap.distributed.run_on_ranks``); the reference is
the same paged greedy loop on the unsharded model in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from tp_ranks import greedy_logits, greedy_on_rank

from warmcap.contracts.parallel import ParallelState, parallel_state, set_parallel_state
from warmcap.distributed import rendezvous_for, run_on_ranks
from warmcap.errors import ConfigError, ModelLoadError
from warmcap.models.decoder import check_tensor_parallel
from warmcap.models.llama import HeadSplit, head_split
from warmcap.models.loader import weight_files
from warmcap.models.presets import resolve_model
from warmcap.models.registry import model_class
from warmcap.models.tiny import SEED, tiny_config

PROMPTS = [[5, 17, 99, 3, 250, 7, 41], [300, 12], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
STEPS = 6


def _qwen3_one_kv_head(out: Path) -> Path:
    """tiny-qwen3 with a single KV head: fewer KV heads than ranks, so it is replicated."""
    import transformers

    config = tiny_config("tiny-qwen3", num_key_value_heads=1)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(SEED)
    transformers.Qwen3ForCausalLM(config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "tiny-llama": Path(resolve_model("tiny-llama")),
        "tiny-qwen3-kv1": _qwen3_one_kv_head(tmp_path_factory.mktemp("qwen3kv1")),
    }


@pytest.mark.slow
@pytest.mark.parametrize(("name", "kv_heads_per_rank"), [("tiny-llama", 1), ("tiny-qwen3-kv1", 1)])
def test_tp2_greedy_and_logits_match_tp1(name, kv_heads_per_rank, model_dirs):
    model_dir = str(model_dirs[name])
    reference = greedy_logits(model_dir, PROMPTS, STEPS)
    ranks = run_on_ranks(greedy_on_rank, rendezvous_for(2), model_dir, PROMPTS, STEPS, timeout_s=120)
    for rank, out in enumerate(ranks):
        assert out["tokens"] == reference["tokens"], f"rank {rank} generated other tokens than TP=1"
        torch.testing.assert_close(out["logits"], reference["logits"], atol=1e-4, rtol=0)
        # Each rank's KV cache holds only its heads.
        assert out["kv_heads"] == [kv_heads_per_rank]
    _assert_ranks_hold_their_slices(model_dirs[name], ranks)


@pytest.mark.slow
def test_tp2_shards_run_the_packed_kernels_and_match_tp1():
    """A rank's column- and row-parallel linears and its vocabulary slice of the LM head are packed
    as an unsharded model's are (the compiled GEMM where it builds, with the q/k/v and gate/up
    groups), so TP=2 runs the same kernels as TP=1; its tokens and logits equal TP=1's packed run."""
    model_dir = str(resolve_model("tiny-llama"))
    reference = greedy_logits(model_dir, PROMPTS, STEPS, packed=True)
    ranks = run_on_ranks(greedy_on_rank, rendezvous_for(2), model_dir, PROMPTS, STEPS, True, timeout_s=120)
    if not reference["packed_classes"]:
        pytest.fail("the loader packed no linear of the unsharded model (no oneDNN in this torch build?)")
    assert reference["packed_classes"] == ["Linear"]
    for rank, out in enumerate(ranks):
        assert out["packed_classes"] == ["ColumnParallelLinear", "ParallelLMHead", "RowParallelLinear"], rank
        assert out["tokens"] == reference["tokens"], f"rank {rank} generated other tokens than TP=1"
        torch.testing.assert_close(out["logits"], reference["logits"], atol=1e-4, rtol=0)


def _assert_ranks_hold_their_slices(model_dir: Path, ranks: list[dict]) -> None:
    """Concatenating the ranks' shards along the split dimension rebuilds the checkpoint tensor
    (replicated tensors and replicated KV heads: every rank holds the full one)."""
    with safe_open(str(weight_files(model_dir)[0]), framework="pt") as f:
        full = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    world = len(ranks)
    for name, tensor in full.items():
        parts = [r["params"][name] for r in ranks]
        if all(p.shape == tensor.shape for p in parts):
            for p in parts:
                torch.testing.assert_close(p, tensor, atol=0, rtol=0)
            continue
        dim = next(d for d in range(tensor.dim()) if parts[0].shape[d] != tensor.shape[d])
        if sum(p.shape[dim] for p in parts) == tensor.shape[dim]:
            torch.testing.assert_close(torch.cat(parts, dim), tensor, atol=0, rtol=0)
        else:
            # Replicated KV heads: rank r holds the KV head its query heads read.
            chunk = parts[0].shape[dim]
            heads = tensor.split(chunk, dim)
            for r, p in enumerate(parts):
                torch.testing.assert_close(p, heads[r * len(heads) // world], atol=0, rtol=0)


@given(kv=st.integers(1, 9), group=st.integers(1, 4), world=st.integers(1, 8))
def test_every_query_head_reads_its_own_kv_head(kv, group, world):
    """Property: on every rank, local query head i reads local KV head i // g, which is the global KV
    head the unsharded model pairs with that query head; across the ranks every query head is held
    exactly once (so the o_proj all-reduce sums each once) and every KV head at least once."""
    heads = kv * group
    if kv < world and heads % world:
        with pytest.raises(ConfigError, match="num_attention_heads"):
            head_split(heads, kv, ParallelState(0, world))
        return
    if kv < world and world % kv:
        with pytest.raises(ConfigError, match="cannot be replicated evenly"):
            head_split(heads, kv, ParallelState(0, world))
        return
    held_q: list[int] = []
    held_kv: set[int] = set()
    for rank in range(world):
        split = head_split(heads, kv, ParallelState(rank, world))
        assert split.num_heads >= 1 and split.num_kv_heads >= 1
        local_group = split.num_heads // split.num_kv_heads
        for i in range(split.num_heads):
            global_q = split.q_start + i
            assert split.kv_start + i // local_group == global_q // group
        held_q += range(split.q_start, split.q_start + split.num_heads)
        held_kv |= set(range(split.kv_start, split.kv_start + split.num_kv_heads))
    assert held_q == list(range(heads))
    assert held_kv == set(range(kv))


def test_uneven_kv_heads_split_by_whole_groups():
    """SmolLM2's 9 query / 3 KV heads over 2 ranks: rank 0 KV heads 0-1 with query heads 0-5,
    rank 1 KV head 2 with query heads 6-8."""
    assert head_split(9, 3, ParallelState(0, 2)) == HeadSplit(0, 6, 0, 2)
    assert head_split(9, 3, ParallelState(1, 2)) == HeadSplit(6, 3, 2, 1)


def test_kv_heads_that_cannot_be_replicated_are_refused():
    with pytest.raises(ConfigError, match="num_key_value_heads = 3 is fewer than"):
        head_split(24, 3, ParallelState(0, 8))


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "BambaForCausalLM"])
def test_unsharded_families_are_refused_under_tp(arch):
    set_parallel_state(ParallelState(0, 2))
    try:
        with pytest.raises(ModelLoadError, match="does not support tensor parallelism yet"):
            check_tensor_parallel(model_class(arch))
    finally:
        set_parallel_state(None)
    assert not parallel_state().is_parallel
    check_tensor_parallel(model_class(arch))


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize(("world", "kv_heads"), [(2, [[2], [1]]), (3, [[1], [1], [1]])])
def test_smollm2_tp_matches_tp1(world, kv_heads):
    """SmolLM2-135M has 9 query and 3 KV heads: over 2 ranks they split unevenly by KV group (2 + 1),
    over 3 ranks one KV head each; either way greedy tokens and logits equal TP=1."""
    model_dir = str(resolve_model("smollm2-135m"))
    prompts, steps = PROMPTS[:2], 4
    reference = greedy_logits(model_dir, prompts, steps)
    ranks = run_on_ranks(greedy_on_rank, rendezvous_for(world), model_dir, prompts, steps, timeout_s=300)
    for rank, out in enumerate(ranks):
        assert out["tokens"] == reference["tokens"], f"rank {rank} generated other tokens than TP=1"
        torch.testing.assert_close(out["logits"], reference["logits"], atol=1e-4, rtol=0)
        assert out["kv_heads"] == kv_heads[rank]
    _assert_ranks_hold_their_slices(Path(model_dir), ranks)
