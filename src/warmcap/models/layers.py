"""Building blocks shared by the decoder models: RMSNorm, gated MLP, activations, and the
tensor-parallel linears and embedding.

Tensor parallelism (:mod:`warmcap.contracts.parallel`): a column-parallel linear holds a contiguous
slice of the output features (no communication); a row-parallel linear holds the matching slice of
the input features and sums its partial products over the ranks; the vocab-parallel embedding holds
a slice of the vocabulary rows and sums the (one non-zero) lookups; the parallel LM head computes its
vocabulary slice's logits and gathers them. Each parallel module records, per parameter, which
slice of the checkpoint tensor it holds (:class:`Shard`), so the loader reads only that slice.
On one rank the factories return plain ``nn.Linear`` / ``nn.Embedding``: single-device models are
exactly what they were.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from warmcap.contracts.parallel import all_gather_last_dim, all_reduce_sum, parallel_state, split_evenly
from warmcap.errors import ModelLoadError
from warmcap.models.packed_linear import packed_group

if TYPE_CHECKING:
    from warmcap.kernels.cpu.layer_ops import LayerOps
    from warmcap.models.fused_ops import FusedOps

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function a config's ``hidden_act`` names."""
    if name not in _ACTIVATIONS:
        raise ModelLoadError(f"hidden_act {name!r} is not supported; use one of {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight in the input dtype.

    ``cpu_ops``: the compiled CPU layer ops (:func:`attach_cpu_layer_ops`), used for float32 rows
    on CPU; ``fused_ops``: the fused Triton ops on CUDA (``models/fused_ops.py``); None (the
    default) or tensors they cannot take run torch's ops.
    """

    cpu_ops: LayerOps | None = None
    fused_ops: FusedOps | None = None

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.fused_ops
        if fused is not None and (out := fused.rms_norm(x, self.weight, self.eps)) is not None:
            return out
        # One fused kernel instead of six elementwise ops. In float32 the weight can go into the
        # kernel; otherwise it scales the result after the cast back, as transformers does.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            ops = self.cpu_ops
            if ops is not None and (out := ops.rms_norm(x, self.weight, self.eps)) is not None:
                return out
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.to(torch.float32), self.weight.shape, eps=self.eps).to(x.dtype)

    def residual(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h + delta, self(h + delta))``: the residual stream after a block and its norm (one
        pass with the CPU layer ops or the fused ops; the sum is exact either way)."""
        fused = self.fused_ops
        if fused is not None and (both := fused.add_rms_norm(h, delta, self.weight, self.eps)) is not None:
            return both
        ops = self.cpu_ops
        if ops is not None and (both := ops.add_rms_norm(h, delta, self.weight, self.eps)) is not None:
            return both
        h = h + delta
        return h, self(h)


def attach_cpu_layer_ops(model: nn.Module, mode: str | None = None) -> LayerOps | None:
    """Hand the compiled CPU layer ops (``kernels/cpu/layer_ops.c``) to every module of ``model``
    that can use them (those declaring ``cpu_ops``), when the config's ``kernel.cpu_layer_ops``
    (``mode``; None: its default) allows and they build; returns them (None: the modules keep
    torch's ops)."""
    from warmcap.kernels.cpu.layer_ops import load_layer_ops

    ops = load_layer_ops(mode)
    if ops is not None:
        for module in model.modules():
            if hasattr(type(module), "cpu_ops"):
                module.cpu_ops = ops
    return ops


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with HF's ``gate_proj``/``up_proj``/``down_proj`` names."""

    #: gate and up read the same input: one packed GEMM on CPU (``models/packed_linear.py``)
    packed_groups: ClassVar[tuple[tuple[str, ...], ...]] = (("gate_proj", "up_proj"),)
    #: the fused Triton ops on CUDA (``models/fused_ops.py``): SiLU and the product in one launch
    fused_ops: FusedOps | None = None

    def __init__(self, hidden: int, intermediate: int, act: str, *, bias: bool = False) -> None:
        super().__init__()
        # Tensor parallel: gate/up split their outputs, down its inputs (one all-reduce per MLP).
        start, size = split_evenly(intermediate, "intermediate_size")
        self.gate_proj = column_linear(hidden, intermediate, start, size, bias=bias)
        self.up_proj = column_linear(hidden, intermediate, start, size, bias=bias)
        self.down_proj = row_linear(intermediate, hidden, start, size, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = packed_group(self.gate_proj, self.up_proj)
        if group is not None and self.act is F.silu:
            # The compiled GEMM applies SiLU and the product as it goes (models/packed_linear.py).
            hidden = group.silu_mul(x)
            if hidden is not None:
                return self.down_proj(hidden)
        fused = self.fused_ops
        if fused is not None:
            return self._fused_forward(fused, x)
        gate, up = (self.gate_proj(x), self.up_proj(x)) if group is None else group(x)
        # The activation's output is fresh: the product goes into it (one temporary, not two).
        return self.down_proj(self.act(gate).mul_(up))

    def _fused_forward(self, fused: FusedOps, x: torch.Tensor) -> torch.Tensor:
        """CUDA with the fused ops: gate/up as one stacked GEMM, SiLU and the product in one launch."""
        from warmcap.models.fused_ops import stacked_product

        gate, up = stacked_product(self, ("gate_proj", "up_proj"), x) or (self.gate_proj(x), self.up_proj(x))
        if self.act is F.silu and (hidden := fused.silu_mul(gate, up)) is not None:
            return self.down_proj(hidden)
        return self.down_proj(self.act(gate).mul_(up))


@dataclass(frozen=True, slots=True)
class Shard:
    """The slice ``[start, start + size)`` along ``dim`` of a checkpoint tensor that one rank holds."""

    dim: int
    start: int
    size: int


class ColumnParallelLinear(nn.Linear):
    """``nn.Linear`` holding output features ``[start, start + size)`` of an ``in -> out`` layer.

    Its output is this rank's slice; nothing is communicated.
    """

    #: the product is the output (packed like a plain linear: ``models/packed_linear.py``)
    finish: Callable[[nn.Linear, torch.Tensor], torch.Tensor] | None = None

    def __init__(self, in_features: int, start: int, size: int, *, bias: bool) -> None:
        super().__init__(in_features, size, bias=bias)
        self.shards = {"weight": Shard(0, start, size)}
        if bias:
            self.shards["bias"] = Shard(0, start, size)


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` holding input features ``[start, start + size)`` of an ``in -> out`` layer; its
    partial products are summed over the ranks, then the (replicated) bias is added once."""

    def __init__(self, out_features: int, start: int, size: int, *, bias: bool) -> None:
        super().__init__(size, out_features, bias=bias)
        self.shards = {"weight": Shard(1, start, size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(F.linear(x, self.weight))

    def finish(self, partial: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """The layer's output from this rank's bias-free partial product (also the packed
        product's: ``models/packed_linear.py``)."""
        # NOTE: the bias must be added after the sum, or it would be counted world_size times.
        y = all_reduce_sum(partial)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` holding vocabulary rows ``[start, start + size)``: ids outside the slice look
    up zeros here and their row on the rank that holds it; the sum over ranks is the full lookup
    (exact: every position gets one non-zero term)."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        start, size = split_evenly(vocab_size, "vocab_size")
        super().__init__(size, hidden)
        self.vocab_start = start
        self.shards = {"weight": Shard(0, start, size)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce_sum(h.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(ColumnParallelLinear):
    """The LM head split by vocabulary rows (the same rows as :class:`VocabParallelEmbedding`, so a
    tied head shares its shard); every rank gets the gathered full-vocabulary logits."""

    #: one rank's slice of the vocabulary (``models/greedy_head.py`` screens it as such)
    vocab_shard: ClassVar[bool] = True

    def __init__(self, hidden: int, vocab_size: int) -> None:
        start, size = split_evenly(vocab_size, "vocab_size")
        super().__init__(hidden, start, size, bias=False)
        self.vocab_start = start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(F.linear(x, self.weight))

    def finish(self, partial: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Every rank's slice of the logits, gathered (the head has no bias)."""
        return all_gather_last_dim(partial)


def column_linear(in_features: int, out_features: int, start: int, size: int, *, bias: bool) -> nn.Linear:
    """A plain ``nn.Linear`` on one rank, else a :class:`ColumnParallelLinear` holding output
    features ``[start, start + size)``."""
    if not parallel_state().is_parallel:
        return nn.Linear(in_features, out_features, bias=bias)
    return ColumnParallelLinear(in_features, start, size, bias=bias)


def row_linear(in_features: int, out_features: int, start: int, size: int, *, bias: bool) -> nn.Linear:
    """A plain ``nn.Linear`` on one rank, else a :class:`RowParallelLinear` holding input features
    ``[start, start + size)``."""
    if not parallel_state().is_parallel:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(out_features, start, size, bias=bias)


def vocab_embedding(vocab_size: int, hidden: int) -> nn.Embedding:
    """A plain ``nn.Embedding`` on one rank, else a :class:`VocabParallelEmbedding`."""
    if not parallel_state().is_parallel:
        weight = torch.empty(vocab_size, hidden)
        if weight.is_meta:
            # NOTE: a meta tensor has no values to initialise, and nn.Embedding's normal_ init on
            # one runs through torch._refs, which imports torch._dynamo (~0.8 s of every start).
            return nn.Embedding(vocab_size, hidden, _weight=weight)
        return nn.Embedding(vocab_size, hidden)
    return VocabParallelEmbedding(vocab_size, hidden)


def lm_head(hidden: int, vocab_size: int) -> nn.Linear:
    """A plain bias-free ``nn.Linear`` on one rank, else a :class:`ParallelLMHead`."""
    if not parallel_state().is_parallel:
        return nn.Linear(hidden, vocab_size, bias=False)
    return ParallelLMHead(hidden, vocab_size)


def checkpoint_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Checkpoint tensor name -> the further parameters read from it: a module's ``reads_from``
    (child -> sibling whose checkpoint tensors it reads, through its own :class:`Shard`; the helper
    rank of ``models/llama.py``'s K/V offload reads its peer's slice of k_proj and v_proj)."""
    out: dict[str, list[str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for child, source in getattr(module, "reads_from", {}).items():
            reader = getattr(module, child)
            for pname, _ in reader.named_parameters(recurse=False):
                base = f"{prefix}." if prefix else ""
                out.setdefault(f"{base}{source}.{pname}", []).append(f"{base}{child}.{pname}")
    return out


def checkpoint_shards(model: nn.Module) -> dict[str, Shard]:
    """Parameter name -> the slice of its checkpoint tensor this rank holds, for every sharded
    parameter of ``model`` (names as ``named_parameters(remove_duplicate=False)`` gives them)."""
    out: dict[str, Shard] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for pname, shard in getattr(module, "shards", {}).items():
            out[f"{prefix}.{pname}" if prefix else pname] = shard
    return out
