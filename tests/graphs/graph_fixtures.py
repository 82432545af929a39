"""A tiny random Llama with a KV cache manager and a runner on the torch paged backend."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LlamaConfig

from warmcap.config import (
    CacheConfig,
    EngineConfig,
    KernelConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from warmcap.core.kv_cache_manager import KVCacheManager
from warmcap.core.kv_spec import group_layers
from warmcap.models.llama import LlamaForCausalLM
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention
from warmcap.runner_v2.model_runner import ModelRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 96
MAX_MODEL_LEN = 64


@dataclass
class Rig:
    config: EngineConfig
    model: LlamaForCausalLM
    manager: KVCacheManager
    runner: ModelRunner


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    hf = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(hf).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def make_rig(
    *,
    k: int = 0,
    max_num_seqs: int = 4,
    budget: int = 24,
    model: LlamaForCausalLM | None = None,
    kernel: KernelConfig | None = None,
) -> Rig:
    model = model or tiny_llama()
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN
        ),
        speculative=SpeculativeConfig("eagle", num_speculative_tokens=k) if k else None,
        kernel=kernel or KernelConfig(),
    )
    groups = group_layers(model.kv_layer_specs(BLOCK_SIZE))
    manager = KVCacheManager(groups, NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    runner = ModelRunner(config, model, groups, NUM_BLOCKS, device="cpu", attn_backend=TorchPagedAttention())
    return Rig(config, model, manager, runner)


def count_forwards(capturer: Any) -> Counter[str]:
    """Count, by graph label, the forwards ``capturer``'s subjects run from now on."""
    calls: Counter[str] = Counter()
    for subject in capturer.subjects.values():
        honest = subject.forward

        def counted(spec, metas, honest=honest):
            calls[spec.label] += 1
            return honest(spec, metas)

        subject.forward = counted
    return calls
