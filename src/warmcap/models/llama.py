"""The Llama family over the runner's paged attention: Llama, Mistral, Qwen2, Qwen3.

Module names mirror transformers (``model.layers.N.self_attn.q_proj`` ...) so checkpoint names load
one-to-one. Members differ only in traits: q/k/v(/o) biases, per-head q/k RMSNorm (Qwen3) and
sliding-window layers (Mistral ``sliding_window``; Qwen ``layer_types``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from warmcap.contracts.forward_context import ForwardContext
from warmcap.contracts.parallel import (
    ParallelState,
    fetch_from_peer,
    mail_floats,
    parallel_state,
    post_to_peer,
    split_evenly,
)
from warmcap.core.kv_spec import FullAttentionSpec, KVSpec, SlidingWindowSpec
from warmcap.errors import ConfigError
from warmcap.models.decoder import DecoderForCausalLM, DecoderModel, KVSettings, PreNormDecoderLayer
from warmcap.models.layers import GatedMLP, RMSNorm, column_linear, row_linear
from warmcap.models.packed_linear import PackedGroup, packed_group
from warmcap.models.rope import RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from warmcap.kernels.cpu.layer_ops import LayerOps
    from warmcap.models.fused_ops import FusedOps


@dataclass(frozen=True, slots=True)
class ArchTraits:
    """What distinguishes one family member from another."""

    #: bias on q/k/v only (Qwen2); otherwise ``config.attention_bias`` sets q/k/v/o bias
    qkv_bias_only: bool = False
    #: per-head RMSNorm on q and k before RoPE (Qwen3)
    qk_norm: bool = False


def head_dim_of(hf_config: Any) -> int:
    """The attention head size: ``head_dim`` when the config sets it, else hidden / heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def sliding_window_of(hf_config: Any, layer_idx: int) -> int | None:
    """The layer's window, or None for full attention.

    ``layer_types`` (Qwen2/3, transformers >= 4.53) decides per layer when present; otherwise a set
    ``sliding_window`` applies to every layer (Mistral).
    """
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window or None


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """Which attention heads one tensor-parallel rank holds: query heads
    ``[q_start, q_start + num_heads)`` and KV heads ``[kv_start, kv_start + num_kv_heads)``."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def head_split(num_heads: int, num_kv_heads: int, state: ParallelState) -> HeadSplit:
    """This rank's attention heads, split by KV group (a KV head and the ``g = num_heads //
    num_kv_heads`` query heads that read it stay on one rank).

    With at least as many KV heads as ranks, rank r holds a contiguous run of whole KV groups; when
    the KV heads do not divide by the world size the first ``num_kv_heads % world_size`` ranks hold
    one group more (3 KV heads over 2 ranks: rank 0 KV heads 0-1 with query heads 0..2g-1, rank 1
    KV head 2 with the rest). The column-parallel q/k/v and the row-parallel o take the matching
    uneven slices, so the o all-reduce still sums every query head exactly once. With fewer KV heads
    than ranks the query heads split evenly and each rank holds a copy of the one KV head its query
    heads read (replicated).

    Either way local query head i reads local KV head ``i // g``.
    """
    if num_heads % num_kv_heads:
        raise ConfigError(
            f"num_attention_heads = {num_heads} is not a multiple of num_key_value_heads = "
            f"{num_kv_heads}; the checkpoint's config.json is inconsistent"
        )
    group = num_heads // num_kv_heads
    if num_kv_heads >= state.world_size:
        base, extra = divmod(num_kv_heads, state.world_size)
        kv_start = state.rank * base + min(state.rank, extra)
        kv_size = base + (1 if state.rank < extra else 0)
        return HeadSplit(kv_start * group, kv_size * group, kv_start, kv_size)
    q_start, q_size = split_evenly(num_heads, "num_attention_heads", state)
    if state.world_size % num_kv_heads:
        raise ConfigError(
            f"num_key_value_heads = {num_kv_heads} is fewer than tensor_parallel_size = "
            f"{state.world_size} and does not divide it, so KV heads cannot be replicated evenly; "
            "choose a tensor_parallel_size that is a multiple of the KV head count, or at most it"
        )
    return HeadSplit(q_start, q_size, q_start // group, 1)


@dataclass(frozen=True, slots=True)
class KVOffload:
    """Two ranks whose attention heads split unevenly (SmolLM2's 3 KV groups: rank 0 two, rank 1
    one) even out their attention work: the helper computes the giver's K and V projections too
    and posts them through the shared-memory mailbox (``distributed/shm_comm.py``), and the giver
    projects only its queries.

    Counted in [hidden x head_dim] slices of weight, a KV group costs ``2g + 2`` (its g query heads'
    q and o, its k and v). SmolLM2 (g = 3): rank 0 held 16, rank 1 8, and every layer's two
    all-reduces made rank 1 wait out the difference; with rank 0's four K/V slices on rank 1 both
    hold 12. The giver keeps its own k/v weights: a step too large for the mailbox (a long prompt
    chunk) is projected as before, both ranks deciding so from the same token count.

    The values are the same bits: each output column of the compiled GEMM is summed the same way
    whatever columns share the call (``models/packed_linear.py``), and RoPE is elementwise.
    """

    #: the rank that holds more heads and receives its K/V
    giver: int
    #: the rank that projects them
    helper: int
    #: the giver's KV heads, all offloaded: global ``[kv_start, kv_start + num_kv_heads)``
    kv_start: int
    num_kv_heads: int


def kv_offload_plan(num_heads: int, num_kv_heads: int, state: ParallelState) -> KVOffload | None:
    """The offload for this split (:class:`KVOffload`), or None: more or fewer than two ranks, an
    even split, no mailbox, or no gain (the giver's K/V slices, ``2 G0``, must be fewer than a
    group's ``2g + 2``, else the helper would end up the busier rank)."""
    if state.world_size != 2 or num_kv_heads < state.world_size or num_kv_heads % 2 == 0:
        return None
    if mail_floats() == 0:
        return None
    group = num_heads // num_kv_heads
    giver_groups = num_kv_heads // 2 + 1
    if giver_groups > group:
        return None
    return KVOffload(giver=0, helper=1, kv_start=0, num_kv_heads=giver_groups)


class LlamaAttention(nn.Module):
    #: q, k and v read the same input: one packed GEMM on CPU (``models/packed_linear.py``)
    packed_groups: ClassVar[tuple[tuple[str, ...], ...]] = (("q_proj", "k_proj", "v_proj"),)
    #: the compiled CPU layer ops, for RoPE (``models/layers.py`` ``attach_cpu_layer_ops``)
    cpu_ops: LayerOps | None = None
    #: the fused Triton ops on CUDA: RoPE and the KV write in one launch (``models/fused_ops.py``)
    fused_ops: FusedOps | None = None

    def __init__(self, hf_config: Any, layer_idx: int, traits: ArchTraits) -> None:
        super().__init__()
        total_heads = hf_config.num_attention_heads
        total_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_heads
        split = head_split(total_heads, total_kv_heads, parallel_state())
        # This rank's heads (all of them on one rank): the KV cache holds num_kv_heads heads.
        self.num_heads = split.num_heads
        self.num_kv_heads = split.num_kv_heads
        self.head_dim = head_dim_of(hf_config)
        self.scale = self.head_dim**-0.5
        self.layer_name = f"model.layers.{layer_idx}.self_attn"
        self.sliding_window = sliding_window_of(hf_config, layer_idx)
        qkv_bias = traits.qkv_bias_only or bool(getattr(hf_config, "attention_bias", False))
        o_bias = not traits.qkv_bias_only and bool(getattr(hf_config, "attention_bias", False))
        hidden, hd = hf_config.hidden_size, self.head_dim
        q_rows = (split.q_start * hd, split.num_heads * hd)
        kv_rows = (split.kv_start * hd, split.num_kv_heads * hd)
        # Tensor parallel: q/k/v split by heads (column), o by the same query heads (row).
        self.q_proj = column_linear(hidden, total_heads * hd, *q_rows, bias=qkv_bias)
        self.k_proj = column_linear(hidden, total_kv_heads * hd, *kv_rows, bias=qkv_bias)
        self.v_proj = column_linear(hidden, total_kv_heads * hd, *kv_rows, bias=qkv_bias)
        self.o_proj = row_linear(total_heads * hd, hidden, *q_rows, bias=o_bias)
        #: the K/V offload between two ranks with uneven heads (:class:`KVOffload`); it runs once
        #: :meth:`settle_kv_offload` found the compiled GEMM on this rank (``kv_offload_on``)
        # (not with q/k norms: the giver would norm what arrives; not worth a path of its own)
        self.kv_offload = (
            None if traits.qk_norm else kv_offload_plan(total_heads, total_kv_heads, parallel_state())
        )
        self.kv_offload_on = False
        self.peer_k_proj: nn.Linear | None = None
        self.peer_v_proj: nn.Linear | None = None
        offload = self.kv_offload
        if offload is not None and parallel_state().rank == offload.helper:
            peer_rows = (offload.kv_start * hd, offload.num_kv_heads * hd)
            self.peer_k_proj = column_linear(hidden, total_kv_heads * hd, *peer_rows, bias=qkv_bias)
            self.peer_v_proj = column_linear(hidden, total_kv_heads * hd, *peer_rows, bias=qkv_bias)
            #: the loader reads these from the checkpoint's k_proj / v_proj (models/loader.py)
            self.reads_from = {"peer_k_proj": "k_proj", "peer_v_proj": "v_proj"}
            # The giver's K/V columns first: the helper computes and posts them before its own.
            self.packed_groups = (("peer_k_proj", "peer_v_proj", "q_proj", "k_proj", "v_proj"),)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if traits.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)

    def kv_specs(self, kv: KVSettings) -> dict[str, KVSpec]:
        """This layer's paged KV: full attention, or a sliding window where the layer has one."""
        spec: KVSpec
        if self.sliding_window is not None:
            spec = SlidingWindowSpec(
                kv.block_size,
                kv.dtype_bytes,
                num_kv_heads=self.num_kv_heads,
                head_size=self.head_dim,
                sliding_window=self.sliding_window,
            )
        else:
            spec = FullAttentionSpec(
                kv.block_size, kv.dtype_bytes, num_kv_heads=self.num_kv_heads, head_size=self.head_dim
            )
        return {self.layer_name: spec}

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[T, heads * head_dim]`` of ``x``: one packed GEMM when q/k/v were grouped."""
        group = packed_group(self.q_proj, self.k_proj, self.v_proj)
        if group is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = group(x)
        return q, k, v

    def _helper_group(self) -> PackedGroup | None:
        if self.peer_k_proj is None or self.peer_v_proj is None:
            return None
        return packed_group(self.peer_k_proj, self.peer_v_proj, self.q_proj, self.k_proj, self.v_proj)

    def settle_kv_offload(self, mode: str) -> bool:
        """Turn the offload on where planned, the config's ``kernel.tp_balance`` (``mode``) is
        ``auto`` and this rank runs the compiled GEMM over whole column blocks; returns whether it
        is on. Every rank decides alike: the same config, the same machine's compiler."""
        offload = self.kv_offload
        self.kv_offload_on = False
        if offload is None or mode != "auto":
            return False
        d = self.head_dim
        if parallel_state().rank == offload.helper:
            group = self._helper_group()
            ok = (
                group is not None
                and group.runs_columns(0)
                and group.runs_columns(2 * offload.num_kv_heads * d)
            )
        else:
            group = packed_group(self.q_proj, self.k_proj, self.v_proj)
            ok = group is not None and group.runs_columns(0) and group.runs_columns(self.num_heads * d)
        self.kv_offload_on = bool(ok) and self.q_norm is None
        return self.kv_offload_on

    def _offload_rows(self, t: int) -> bool:
        """Whether a pass of ``t`` tokens goes through the mailbox (both ranks decide alike)."""
        offload = self.kv_offload
        assert offload is not None
        return self.kv_offload_on and t * 2 * offload.num_kv_heads * self.head_dim <= mail_floats()

    def _own_product(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """This rank's q|k|v product (one tensor) on the packed path, or None (not packed). The
        helper of an offload first posts the giver's K/V; the giver gets ``(q, its K/V)``, the K/V
        ``[T, 2 * kv_heads * head_dim]`` as the helper posted them (not yet rotated)."""
        helper = self._helper_group()
        if helper is not None:
            peer = helper.sizes[0] + helper.sizes[1]
            if self._offload_rows(x.shape[0]):
                post_to_peer(helper.columns(x, 0, peer))
            return helper.columns(x, peer, sum(helper.sizes) - peer), None
        group = packed_group(self.q_proj, self.k_proj, self.v_proj)
        if group is None:
            return None
        offload = self.kv_offload
        if offload is not None and self._offload_rows(x.shape[0]):
            t, d = x.shape[0], self.head_dim
            q = group.columns(x, 0, self.num_heads * d)
            # Projected after the queries: the helper projected these first, so they are ready.
            return q, fetch_from_peer(offload.helper, (t, 2 * self.num_kv_heads * d))
        return group.product(x), None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        fused = self.fused_ops
        if fused is not None:
            caches = getattr(ctx, "kv_caches", None)
            kv_cache = None if caches is None else caches.get(self.layer_name)
            if kv_cache is not None:
                return self._fused_forward(fused, x, cos, sin, ctx, kv_cache)
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        own = self._own_product(x) if self.q_norm is None else None
        ops = self.cpu_ops
        qkv, kv = own if own is not None else (None, None)
        if qkv is not None and kv is not None:
            # The giver of a K/V offload: q is its product, K/V came from the helper.
            q, k = qkv.view(t, hq, d), kv[:, : hkv * d].view(t, hkv, d)
            v = kv[:, hkv * d :].view(t, hkv, d)
            # Fresh product and a message read only here: both may be rotated in place.
            if ops is None or not ops.rope_(q, cos, sin):
                q = apply_rope(q, cos, sin)
            if ops is None or not ops.rope_(k, cos, sin):
                k = apply_rope(k, cos, sin)
        elif qkv is not None:
            # q and k are adjacent columns of one product: rotate them in one pass (elementwise, so
            # the same values as a pass each).
            qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
            # The product is fresh: the CPU layer ops may rotate it in place (the same bits).
            if ops is None or not ops.rope_(qk, cos, sin):
                qk = apply_rope(qk, cos, sin)
            q, k = qk.split((hq, hkv), dim=1)
            v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        else:
            q, k, v = self.project(x)
            q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ctx.attention(self.layer_name, q, k, v, scale=self.scale, sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def _fused_forward(
        self,
        fused: FusedOps,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The forward with RoPE and the KV write in one launch: k and v land at the pass's slot
        mapping, the slots the KV-write log records, and the backend is told they are in place."""
        from warmcap.models.fused_ops import stacked_product

        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        # One GEMM for q/k/v where the loader stacked them (models/fused_ops.py StackedLinear).
        q, k, v = stacked_product(self, ("q_proj", "k_proj", "v_proj"), x) or self.project(x)
        # The projections are fresh: the kernel rotates q and k in place.
        q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        slots = ctx.metadata(self.layer_name).slot_mapping
        written = fused.rope_write_kv(q, k, v, cos, sin, kv_cache, slots)
        if not written:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ctx.attention(
            self.layer_name, q, k, v, scale=self.scale, sliding_window=self.sliding_window, kv_written=written
        )
        return self.o_proj(out.reshape(t, hq * d))


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, hf_config: Any, layer_idx: int, traits: ArchTraits) -> None:
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        super().__init__(
            hf_config.hidden_size,
            hf_config.rms_norm_eps,
            LlamaAttention(hf_config, layer_idx, traits),
            GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act, bias=mlp_bias),
        )


class LlamaForCausalLM(DecoderForCausalLM):
    """A Llama-family causal LM whose attention runs through :class:`ForwardContext`."""

    traits: ClassVar[ArchTraits] = ArchTraits()
    supports_tensor_parallel: ClassVar[bool] = True

    def __init__(self, hf_config: Any, *, dtype: torch.dtype = torch.float32) -> None:
        layers = (LlamaDecoderLayer(hf_config, i, self.traits) for i in range(hf_config.num_hidden_layers))
        rotary = RotaryEmbedding.from_config(hf_config, head_dim_of(hf_config))
        super().__init__(hf_config, DecoderModel(hf_config, layers), rotary, dtype=dtype)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with (optional) sliding-window attention in every layer."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: bias on q/k/v projections."""

    traits: ClassVar[ArchTraits] = ArchTraits(qkv_bias_only=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head RMSNorm on q and k, bias per ``attention_bias``."""

    traits: ClassVar[ArchTraits] = ArchTraits(qk_norm=True)
