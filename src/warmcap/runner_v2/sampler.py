"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Random rows draw by the exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which samples from
``p`` exactly. A seeded row draws its noise from its own generator, so it picks the same tokens
whatever else shares the batch; unseeded rows share one draw from the runner's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

#: columns per block of :func:`row_argmax`'s first pass
_ARGMAX_BLOCK = 1024


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D float tensor, the same indices (the first maximum; a NaN counts
    as the maximum, as for ``argmax``).

    On CPU ``argmax`` is a scalar loop, about 25x slower than the vectorised ``amax`` over a 49k
    vocabulary (1 ms per 16 rows, BENCHMARKS.md). So: the maximum of each block of columns, the first
    block holding the row's maximum, then ``argmax`` inside that block only.
    """
    rows, cols = x.shape
    if x.device.type != "cpu" or cols < 4 * _ARGMAX_BLOCK:
        return x.argmax(dim=-1)
    whole = cols - cols % _ARGMAX_BLOCK
    block_max = x[:, :whole].reshape(rows, -1, _ARGMAX_BLOCK).amax(dim=-1)
    if whole < cols:
        block_max = torch.cat((block_max, x[:, whole:].amax(dim=-1, keepdim=True)), dim=1)
    start = block_max.argmax(dim=-1, keepdim=True) * _ARGMAX_BLOCK
    # NOTE: the last block may be short: its columns past the end read the last column again,
    # after it, so the first maximum is still a real column.
    index = (start + torch.arange(_ARGMAX_BLOCK, device=x.device)).clamp_(max=cols - 1)
    return (start + x.gather(1, index).argmax(dim=-1, keepdim=True)).squeeze(1)


@dataclass(slots=True)
class SamplingMetadata:
    """Per logits row settings (a request verifying k drafts contributes 1 + k rows)."""

    temperature: torch.Tensor  # float32 [N]; 0 = greedy
    top_k: torch.Tensor  # int64 [N]; 0 = off
    top_p: torch.Tensor  # float32 [N]; 1 = off
    min_p: torch.Tensor  # float32 [N]; 0 = off
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def from_rows(
        cls,
        temperature: torch.Tensor | np.ndarray,
        top_k: torch.Tensor | np.ndarray,
        top_p: torch.Tensor | np.ndarray,
        min_p: torch.Tensor | np.ndarray,
        generators: list[torch.Generator | None],
        device: torch.device | str | None = None,
    ) -> SamplingMetadata:
        """From host arrays (the persistent batch's numpy rows, or CPU tensors); the flags are
        worked out on the host, so building the metadata never reads a device. ``device``: where
        the settings are used (a CUDA runner's): they go there once, through page-locked memory
        without blocking, when the metadata is built (the runner reuses it while the batch's
        composition holds), not on every step that samples."""
        temp, k, p, mp = (
            a if isinstance(a, np.ndarray) else a.numpy() for a in (temperature, top_k, top_p, min_p)
        )
        random = temp > 0
        tensors = [torch.as_tensor(a) for a in (temp, k, p, mp)]
        if device is not None and torch.device(device).type != "cpu" and random.any():
            tensors = [t.pin_memory().to(device, non_blocking=True) for t in tensors]
        return cls(
            temperature=tensors[0],
            top_k=tensors[1],
            top_p=tensors[2],
            min_p=tensors[3],
            generators=generators,
            all_greedy=not bool(random.any()),
            any_top_k=bool(((k > 0) & random).any()),
            any_top_p=bool(((p < 1) & random).any()),
            any_min_p=bool(((mp > 0) & random).any()),
        )


class Sampler:
    """Picks one token per logits row."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """``logits`` float32 ``[N, V]`` -> token ids int64 ``[N]``."""
        greedy = row_argmax(logits)
        if meta.all_greedy:
            return greedy
        probs = self.probs(logits, meta)
        noise = self._exponential_noise(probs, meta.generators)
        sampled = row_argmax(probs / noise)
        return torch.where(meta.temperature.to(logits.device) > 0, sampled, greedy)

    def probs(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution each random row samples from (temperature, then top-k, top-p, min-p)."""
        temp = meta.temperature.to(logits.device)
        scaled = logits / torch.where(temp > 0, temp, 1.0).unsqueeze(1)
        if meta.any_top_k or meta.any_top_p:
            scaled = _top_k_top_p(scaled, meta.top_k.to(logits.device), meta.top_p.to(logits.device))
        probs = scaled.softmax(dim=-1)
        if meta.any_min_p:
            floor = meta.min_p.to(logits.device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs

    def _exponential_noise(
        self, probs: torch.Tensor, generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        noise = exponential(torch.empty_like(probs), self.generator)
        for i, gen in enumerate(generators):
            if gen is not None:
                # NOTE: the generator lives on the host so its stream does not depend on the device.
                row = exponential(torch.empty(probs.shape[1], dtype=probs.dtype), gen)
                noise[i] = row.to(probs.device)
        return noise


def exponential(out: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``out`` filled with Exp(1) draws, in place: ``-log(U)``, U uniform on [0, 1) (so every draw is
    > 0; U = 0 gives +inf, which only removes that one token from that one race).

    NOTE: not ``Tensor.exponential_``: on CPU that draws one value at a time (30 ms for a 32-row
    step over SmolLM2's 49152 tokens on a Zen 4 core, a third of the whole decode step), where
    ``uniform_`` and ``log_`` run in vectors (6.8 ms). The same distribution; another stream of
    draws for a given seed."""
    return out.uniform_(generator=generator).log_().neg_()


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf (ties at the k-th value
    stay in; the most likely token always stays)."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    drop_sorted = sorted_logits < kth
    sorted_probs = sorted_logits.masked_fill(drop_sorted, float("-inf")).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted |= mass_before >= top_p.unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
