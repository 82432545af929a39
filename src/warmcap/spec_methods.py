"""The speculative methods warmcap knows, one table entry each, and the facts the engine derives.

Everything outside the drafters that depends on the method reads it from :data:`METHODS`: the
config (valid names, lookahead L, the uniform decode query length), the KV reservation (through
``EngineConfig.num_lookahead_tokens``) and the drafter factory (which weights to load, which target
layers to fuse). Adding a method is one entry here plus its drafter class, registered in
``drafters/registry.py``.

No torch: ``config.py`` imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from warmcap.errors import ConfigError

#: where a method's drafting weights come from: nothing, a whole causal LM, or a head tied to the target
Weights = Literal["none", "draft_model", "head"]


def low_mid_high_layers(num_layers: int) -> tuple[int, int, int]:
    """Target layers whose inputs EAGLE-3-style heads fuse: low, middle and high (the usual choice)."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


@dataclass(frozen=True, slots=True)
class SpecMethod:
    """One speculative method: what it loads, what it reads from the target, how far it writes."""

    name: str
    weights: Weights
    #: KV slots written past the scheduled tokens beyond the k drafts; None when it writes no KV
    extra_lookahead: int | None
    #: reads the target's hidden states of each step (final, or the ``aux_layers`` inputs)
    reads_hidden_states: bool
    #: the target layers fused when a head names none; None: the head reads the final state only
    default_aux_layers: Callable[[int], tuple[int, ...]] | None = None
    #: proposes exactly k drafts for every decoding request (False: any number from 0 to k, so
    #: decode steps verify rows of different lengths)
    fixed_drafts: bool = True

    @property
    def needs_head(self) -> bool:
        """Drafts with a head over the target's hidden states (a head directory or random weights)."""
        return self.weights == "head"

    @property
    def needs_draft_model(self) -> bool:
        """Drafts with an independent causal LM sharing the target's vocabulary."""
        return self.weights == "draft_model"

    def lookahead(self, num_speculative_tokens: int) -> int:
        """L: KV slots the drafter writes past a request's scheduled tokens for k draft tokens; the
        KV cache manager reserves exactly this many."""
        if self.extra_lookahead is None:
            return 0
        return num_speculative_tokens + self.extra_lookahead

    def uniform_decode_query_len(self, num_speculative_tokens: int) -> int:
        """Query tokens of a decode step that verifies k drafts: the sampled token plus the drafts.
        1 + k for every method, whatever its lookahead."""
        return 1 + num_speculative_tokens

    def aux_layers(self, num_target_layers: int, configured: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The target layers the drafter fuses: those a head's config names, else the method's
        default; empty for methods that read the final hidden state (or none)."""
        if self.default_aux_layers is None:
            return ()
        return tuple(configured) or self.default_aux_layers(num_target_layers)


def _table(*methods: SpecMethod) -> Mapping[str, SpecMethod]:
    return MappingProxyType({m.name: m for m in methods})


METHODS: Mapping[str, SpecMethod] = _table(
    # Prompt lookup: no model, so no KV and no lookahead.
    # A suffix without an earlier match drafts nothing, so a row verifies 0..k drafts.
    SpecMethod("ngram", weights="none", extra_lookahead=None, reads_hidden_states=False, fixed_drafts=False),
    # k autoregressive passes; the last draft's KV is never written, the sampled token's is.
    SpecMethod("draft_model", weights="draft_model", extra_lookahead=0, reads_hidden_states=False),
    SpecMethod("eagle", weights="head", extra_lookahead=0, reads_hidden_states=True),
    SpecMethod(
        "eagle3",
        weights="head",
        extra_lookahead=0,
        reads_hidden_states=True,
        default_aux_layers=low_mid_high_layers,
    ),
    SpecMethod("mtp", weights="head", extra_lookahead=0, reads_hidden_states=True),
    # One block pass over [sampled, mask * k]: one query (and one KV slot) more than k.
    SpecMethod(
        "dflash",
        weights="head",
        extra_lookahead=1,
        reads_hidden_states=True,
        default_aux_layers=low_mid_high_layers,
    ),
)


def spec_method(name: str) -> SpecMethod:
    """The table entry of method ``name``; a :class:`ConfigError` naming the valid methods if none."""
    method = METHODS.get(name) if isinstance(name, str) else None
    if method is None:
        raise ConfigError(f"unknown speculative method {name!r}: use one of {', '.join(METHODS)}")
    return method
