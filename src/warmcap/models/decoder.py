"""The decoder skeleton the models share: a pre-norm residual layer, the layer loop (with EAGLE-3's
aux hidden states), HF's ``model`` container (``embed_tokens`` -> ``layers`` -> final norm) and the
causal-LM shell around it (RoPE, LM head, the checkpoint load with its tied-head rule, the KV specs
gathered layer by layer).

Checkpoints load by parameter name, so the parts are registered under the names each architecture's
checkpoint uses (``self_attn``/``mamba``, ``mlp``/``feed_forward``, ``norm``/``final_layernorm`` ...).
A family adds only what differs: its layers, its mixers' KV specs (:meth:`KVMixer.kv_specs`) and,
where checkpoint names are not one-to-one, :meth:`DecoderForCausalLM.weight_target`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

from warmcap.contracts.parallel import parallel_state
from warmcap.errors import ModelLoadError
from warmcap.models.greedy_head import (
    GreedyHead,
    ShardedGreedyHead,
    is_vocab_shard,
    screen_bytes,
    screen_mode,
)
from warmcap.models.greedy_head import enabled as greedy_head_enabled
from warmcap.models.layers import ParallelLMHead, RMSNorm, lm_head, vocab_embedding
from warmcap.models.packed_linear import PackedLinear

if TYPE_CHECKING:
    from warmcap.contracts.forward_context import ForwardContext
    from warmcap.core.kv_spec import KVSpec
    from warmcap.models.fused_ops import FusedGreedyHead
    from warmcap.models.rope import RotaryEmbedding

#: checkpoint entries that carry no weights of ours (recomputed buffers)
IGNORED_WEIGHT_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)
#: the two names of a tied LM head (``tie_word_embeddings``)
EMBEDDING_WEIGHT = "model.embed_tokens.weight"
LM_HEAD_WEIGHT = "lm_head.weight"


@dataclass(frozen=True, slots=True)
class KVSettings:
    """The engine's KV settings, the same for every layer (``DecoderForCausalLM.kv_layer_specs``):
    each mixer builds its cache spec(s) from them."""

    block_size: int
    #: bytes per element of the model's dtype
    dtype_bytes: int
    #: Mamba state caching (``none``/``all``/``align``); attention ignores it
    mamba_cache_mode: str = "none"
    #: draft tokens k: a Mamba layer keeps 1 + k state slots per request
    num_speculative_blocks: int = 0
    max_model_len: int | None = None


class KVMixer(Protocol):
    """A decoder layer's mixer as :meth:`DecoderForCausalLM.kv_layer_specs` asks it."""

    def kv_specs(self, kv: KVSettings) -> dict[str, KVSpec]:
        """This mixer's cache spec(s), keyed by the layer name(s) it passes to its backend."""
        ...


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

    def kv_layer_specs(
        self,
        block_size: int,
        *,
        mamba_cache_mode: str = "none",
        num_speculative_blocks: int = 0,
        max_model_len: int | None = None,
    ) -> dict[str, KVSpec]:
        """Each layer's cache spec(s) in layer order, keyed by the layer name its mixer passes to
        attention (an MLA layer with an indexer gives two, the indexer its own group).

        The keyword options are the engine's uniform call (``warmcap.kv_layout.layer_specs``); only
        Mamba layers read them.
        """
        kv = KVSettings(
            block_size,
            torch.empty((), dtype=self.dtype).element_size(),
            mamba_cache_mode=mamba_cache_mode,
            num_speculative_blocks=num_speculative_blocks,
            max_model_len=max_model_len,
        )
        specs: dict[str, KVSpec] = {}
        for layer in self.model.layers:
            mixer: KVMixer = layer.mixer
            specs.update(mixer.kv_specs(kv))
        return specs

    def weight_target(self, name: str) -> tuple[str, int | None] | None:
        """Where checkpoint tensor ``name`` goes: (parameter name, row of a stacked parameter or
        None for the whole parameter), or None when this model keeps no such weight.

        Names are one-to-one here; a family whose checkpoint splits a parameter (DeepSeek's
        per-expert tensors) or stores extra layers overrides this.
        """
        if name.endswith(IGNORED_WEIGHT_SUFFIXES):
            return None
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, assign: bool = False) -> None:
        """Copy HF-named tensors into the parameters (through :meth:`weight_target`); every parameter,
        and every row of a stacked one, must be given (the LM head or the embedding may be absent
        when tied). Raises ModelLoadError naming the weight.

        ``assign``: adopt each whole tensor (cast to the parameter's dtype and device) as the
        parameter's storage instead of copying it; for callers that hand over tensors nobody else
        holds. Rows of stacked parameters are always copied.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        stacked_rows: dict[str, set[int]] = {}
        target_of = self.weight_target
        with torch.no_grad():
            for name, tensor in weights:
                where = target_of(name)
                if where is None:
                    continue
                target, row = where
                param = params.get(target)
                if param is None:
                    raise ModelLoadError(
                        f"unexpected weight {name!r}: {type(self).__name__} has no such parameter; "
                        "check that config.json's architectures matches the checkpoint"
                    )
                dest = param if row is None else param[row]
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ModelLoadError(
                        f"weight {name!r} has shape {tuple(tensor.shape)} but the config implies "
                        f"{tuple(dest.shape)}; the checkpoint does not match config.json"
                    )
                if row is not None:
                    dest.copy_(tensor.to(dtype=param.dtype))
                    stacked_rows.setdefault(target, set()).add(row)
                    continue
                if assign:
                    # NOTE: a tied head is the same Parameter object, so this rebinds both names.
                    param.data = tensor.to(dtype=param.dtype, device=param.device)
                else:
                    param.copy_(tensor.to(dtype=param.dtype))
                loaded.add(target)
        loaded.update(t for t, rows in stacked_rows.items() if len(rows) == params[t].shape[0])
        self._check_complete(set(params), loaded)

    def _check_complete(self, params: set[str], loaded: set[str]) -> None:
        """ModelLoadError listing the parameters the checkpoint did not give."""
        if self.tie_word_embeddings:
            # Tied: the head is the embedding, whichever of the two names the checkpoint stored.
            if LM_HEAD_WEIGHT in loaded:
                loaded.add(EMBEDDING_WEIGHT)
            loaded.add(LM_HEAD_WEIGHT)
        missing = sorted(params - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint lacks weight(s) {shown}; the checkpoint is incomplete")

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

    def greedy_head(
        self, setting: str | None = None
    ) -> GreedyHead | ShardedGreedyHead | FusedGreedyHead | None:
        """The exact screened argmax of :meth:`compute_logits` (``models/greedy_head.py``), built
        now, or with the fused ops on CUDA their one-launch argmax (``models/fused_ops.py``); None
        where neither applies: a family whose logits are more than ``lm_head(hidden)``, or a head
        that is neither (batch-invariant, a GPU without the fused ops), or ``setting`` (the
        config's ``kernel.exact_greedy_head``; None: its default) is off. A tensor-parallel head on
        CPU gets a :class:`ShardedGreedyHead` (each rank screens its slice of the vocabulary)."""
        if not self._logits_are_the_head() or not greedy_head_enabled(setting):
            return None
        fused = getattr(self.model.final_norm, "fused_ops", None)
        if fused is not None and type(self.lm_head) is nn.Linear and fused.accepts(self.lm_head.weight):
            from warmcap.models.fused_ops import FusedGreedyHead

            # CUDA with the fused ops: the head's product, then one argmax launch over it.
            return FusedGreedyHead(self.lm_head, fused)
        # The CPU layer ops, where the loader attached them, also hold the head's candidate test.
        ops = getattr(self.model.final_norm, "cpu_ops", None)
        head = self.lm_head
        if is_vocab_shard(head):
            # Tensor parallel on CPU: every rank holds a sharded head (its own screen, or none
            # where this machine cannot screen), since the heads exchange their rows' maxima.
            return ShardedGreedyHead(GreedyHead.build(head, ops, setting), head.vocab_start)
        return GreedyHead.build(head, ops, setting)

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
            or not (
                type(head) in (nn.Linear, ParallelLMHead)
                or (type(head) is PackedLinear and (head.is_plain or is_vocab_shard(head)))
            )
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
