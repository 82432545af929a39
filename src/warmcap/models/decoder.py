"""The decoder skeleton the models share: a pre-norm residual layer, the layer loop (with EAGLE-3's
aux hidden states), HF's ``model`` container (``embed_tokens`` -> ``layers`` -> final norm) and the
causal-LM shell around it (RoPE, LM head).

Checkpoints load by parameter name, so the parts are registered under the names each architecture's
checkpoint uses (``self_attn``/``mamba``, ``mlp``/``feed_forward``, ``norm``/``final_layernorm`` ...).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from warmcap.contracts.parallel import parallel_state
from warmcap.errors import ModelLoadError
from warmcap.models.greedy_head import GreedyHead, screen_bytes, screen_mode
from warmcap.models.greedy_head import enabled as greedy_head_enabled
from warmcap.models.layers import RMSNorm, lm_head, vocab_embedding
from warmcap.models.packed_linear import PackedLinear

if TYPE_CHECKING:
    from warmcap.contracts.forward_context import ForwardContext
    from warmcap.models.fused_ops import FusedGreedyHead
    from warmcap.models.rope import RotaryEmbedding


class PreNormDecoderLayer(nn.Module):
    """``h + mixer(input_layernorm(h))``, then ``h + mlp(post_norm(h))``.

    The mixer is called as attention, ``mixer(x, cos, sin, ctx)``; a layer whose mixer takes other
    arguments overrides :meth:`mix`. ``*_name`` are the checkpoint's names for the parts.
    """

    # NOTE: no part may be named like an attribute of this class (``mixer``, ``ffn``, ``post_norm``,
    # ``mix``): ``add_module`` would raise.

    def __init__(
        self,
        hidden: int,
        eps: float,
        mixer: nn.Module,
        mlp: nn.Module,
        *,
        mixer_name: str = "self_attn",
        mlp_name: str = "mlp",
        post_norm_name: str = "post_attention_layernorm",
    ) -> None:
        super().__init__()
        self._mixer_name, self._mlp_name, self._post_norm_name = mixer_name, mlp_name, post_norm_name
        self.add_module(mixer_name, mixer)
        self.add_module(mlp_name, mlp)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.add_module(post_norm_name, RMSNorm(hidden, eps))

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self._mixer_name)

    @property
    def ffn(self) -> nn.Module:
        return getattr(self, self._mlp_name)

    @property
    def post_norm(self) -> nn.Module:
        return getattr(self, self._post_norm_name)

    def mix(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self._modules[self._mixer_name](x, cos, sin, ctx)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        # Parts by their registered names straight from ``_modules``: this runs once per layer and
        # token step, and ``nn.Module.__getattr__`` behind the properties costs more than the dict.
        parts = self._modules
        h, x = parts[self._post_norm_name].residual(h, self.mix(parts["input_layernorm"](h), cos, sin, ctx))
        return h + parts[self._mlp_name](x)


def run_decoder_layers(
    layers: nn.ModuleList, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
) -> torch.Tensor:
    """Run ``layers`` in order; for each index i in ``ctx.aux_hidden_state_layers`` (in the listed
    order) append the residual stream *entering* layer i to ``ctx.aux_hidden_states`` (index 0 is
    the embeddings, ``len(layers)`` the last layer's output before the final norm)."""
    wanted = ctx.aux_hidden_state_layers
    captured: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        if i in wanted:
            captured[i] = h
        h = layer(h, cos, sin, ctx)
    if len(layers) in wanted:
        captured[len(layers)] = h
    ctx.aux_hidden_states.extend(captured[i] for i in wanted)
    return h


class DecoderModel(nn.Module):
    """HF's ``model`` module: ``embed_tokens``, ``layers`` and the final RMSNorm (``norm_name``)."""

    def __init__(self, hf_config: Any, layers: Iterable[nn.Module], *, norm_name: str = "norm") -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self._norm_name = norm_name
        self.add_module(norm_name, RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps))

    @property
    def final_norm(self) -> nn.Module:
        return getattr(self, self._norm_name)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Embedded inputs [T, hidden] -> final-normed hidden states, collecting aux hidden states as
        :func:`run_decoder_layers` does."""
        return self.final_norm(run_decoder_layers(self.layers, h, cos, sin, ctx))


class DecoderForCausalLM(nn.Module):
    """A causal LM over a :class:`DecoderModel`: RoPE from ``rotary``, an LM head tied to the
    embedding when the config says so, parameters cast to ``dtype``.

    ``supports_tensor_parallel``: whether the family's layers shard themselves by
    :func:`~warmcap.contracts.parallel.parallel_state`; a family that does not is refused under
    tensor parallelism (:func:`check_tensor_parallel`).
    """

    supports_tensor_parallel: ClassVar[bool] = False

    def __init__(
        self, hf_config: Any, model: DecoderModel, rotary: RotaryEmbedding, *, dtype: torch.dtype
    ) -> None:
        super().__init__()
        check_tensor_parallel(type(self))
        self.hf_config = hf_config
        self.dtype = dtype
        self.model = model
        self.lm_head = lm_head(hf_config.hidden_size, hf_config.vocab_size)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.tie_weights()
        self.rotary = rotary
        self.to(dtype)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config ties them."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        *,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T] ids and positions -> final-normed hidden states [T, hidden].

        ``ctx.aux_hidden_state_layers`` (EAGLE-3): for each listed index i, in the listed order, the
        residual stream *entering* layer i (the output of layer i-1; index 0 is the embeddings and
        ``num_hidden_layers`` the last layer's output before the final norm) is appended to
        ``ctx.aux_hidden_states``. This equals transformers' ``hidden_states[i]`` for i < L.
        """
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        return self.model(h, cos, sin, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head(hidden).float()

    def greedy_head(self, setting: str | None = None) -> GreedyHead | FusedGreedyHead | None:
        """The exact screened argmax of :meth:`compute_logits` (``models/greedy_head.py``), built
        now, or with the fused ops on CUDA their one-launch argmax (``models/fused_ops.py``); None
        where neither applies: a family whose logits are more than ``lm_head(hidden)``, or a head
        that is neither (batch-invariant, tensor-parallel, a GPU without the fused ops), or
        ``setting`` (the config's ``kernel.exact_greedy_head``; None: its default) is off."""
        if not self._logits_are_the_head() or not greedy_head_enabled(setting):
            return None
        fused = getattr(self.model.final_norm, "fused_ops", None)
        if fused is not None and type(self.lm_head) is nn.Linear and fused.accepts(self.lm_head.weight):
            from warmcap.models.fused_ops import FusedGreedyHead

            # CUDA with the fused ops: the head's product, then one argmax launch over it.
            return FusedGreedyHead(self.lm_head, fused)
        # The CPU layer ops, where the loader attached them, also hold the head's candidate test.
        return GreedyHead.build(self.lm_head, getattr(self.model.final_norm, "cpu_ops", None), setting)

    def _logits_are_the_head(self) -> bool:
        """:meth:`compute_logits` is ``lm_head(hidden)`` itself (not overridden by the family)."""
        return type(self).compute_logits is DecoderForCausalLM.compute_logits

    def greedy_head_bytes(
        self, device: torch.device | str, *, batch_invariant: bool, setting: str | None = None
    ) -> int:
        """What :meth:`greedy_head` will hold once this model is loaded on ``device`` and packed,
        decided by the rules of that build and of ``prepack_linears`` (not by what exists now), so a
        model on the meta device and the loaded one give the same number: KV sizing counts it
        (``assembly.resident_bytes``)."""
        head = self.lm_head
        mode = screen_mode(setting)
        if (
            batch_invariant
            or torch.device(device).type != "cpu"
            or not greedy_head_enabled(setting)
            or not self._logits_are_the_head()
            or type(head) not in (nn.Linear, PackedLinear)
            or head.bias is not None
            or head.weight.dtype != torch.float32
            or mode is None
        ):
            return 0
        return screen_bytes(*head.weight.shape, portable=mode == "portable")


def check_tensor_parallel(cls: type[nn.Module], world_size: int | None = None) -> None:
    """ModelLoadError when tensor parallelism is on (``world_size`` > 1; default: this process's
    parallel state) and ``cls`` cannot be sharded."""
    world = parallel_state().world_size if world_size is None else world_size
    if world > 1 and not getattr(cls, "supports_tensor_parallel", False):
        raise ModelLoadError(
            f"{cls.__name__} does not support tensor parallelism yet (MLA, MoE and Mamba layers are "
            f"not sharded); got tensor_parallel_size = {world}: run it with "
            "tensor_parallel_size = 1"
        )
