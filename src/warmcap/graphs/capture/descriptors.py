"""Graph keys and dispatch: which captured graph (if any) serves a real batch.

A graph is keyed by a frozen :class:`BatchDescriptor`. Two kinds exist:

- **uniform decode** (``uniform_query_len`` set, FULL): every request has exactly that many query
  tokens (1 + k: the sampled token and k drafts); ``num_tokens == uniform_query_len * num_reqs``.
- **mixed** (``uniform_query_len`` None): any batch of at most ``num_tokens`` tokens and at most
  :attr:`BatchDescriptor.request_cap` requests, prefills included.

A batch with any request still in its prompt never goes to a uniform-decode graph, even if its
query lengths happen to be uniform: a 2-token prompt chunk and a 1+k=2 verify step look alike but
are not the same computation (docs/graphs.md).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from warmcap.errors import ConfigError


class CUDAGraphMode(str, Enum):
    """How a shape runs: one whole-forward graph, graphs between attention calls, or eagerly."""

    FULL = "FULL"
    PIECEWISE = "PIECEWISE"
    NONE = "NONE"


@dataclass(frozen=True, slots=True)
class BatchDescriptor:
    """The key of one captured graph."""

    mode: CUDAGraphMode
    num_tokens: int
    num_reqs: int | None = None
    uniform_query_len: int | None = None

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ConfigError(f"a graph needs at least one token; got num_tokens={self.num_tokens}")
        if self.num_reqs is not None and not 1 <= self.num_reqs <= self.num_tokens:
            raise ConfigError(f"num_reqs must be in 1..num_tokens ({self.num_tokens}); got {self.num_reqs}")
        q = self.uniform_query_len
        if q is not None and (self.num_reqs is None or q * self.num_reqs != self.num_tokens):
            raise ConfigError(
                f"a uniform-decode graph needs num_tokens == uniform_query_len * num_reqs; got "
                f"{self.num_tokens} tokens, {self.num_reqs} requests, query length {q}"
            )

    @property
    def is_uniform_decode(self) -> bool:
        """Whether only all-decode batches of exactly ``uniform_query_len`` per request fit."""
        return self.uniform_query_len is not None

    @property
    def request_cap(self) -> int:
        """Most requests this graph holds (every request has at least one token)."""
        return self.num_reqs if self.num_reqs is not None else self.num_tokens

    @property
    def label(self) -> str:
        """Short human-readable key, e.g. ``FULL t=8 r=4 q=2``."""
        return _key_text(self.mode.value, self.num_tokens, self.num_reqs, self.uniform_query_len)


def graph_label(
    phase: str, mode: str, num_tokens: int, num_reqs: int | None, uniform_query_len: int | None
) -> str:
    """``decode FULL t=8 r=4 q=2``: the one name of a graph, in the capture plan, the report, the
    start-up cache and the pages (a graph is looked up across them by this string)."""
    return f"{phase} {_key_text(mode, num_tokens, num_reqs, uniform_query_len)}"


def _key_text(mode: str, num_tokens: int, num_reqs: int | None, uniform_query_len: int | None) -> str:
    parts = [mode, f"t={num_tokens}"]
    if num_reqs is not None:
        parts.append(f"r={num_reqs}")
    if uniform_query_len is not None:
        parts.append(f"q={uniform_query_len}")
    return " ".join(parts)


@dataclass(frozen=True, slots=True)
class BatchShape:
    """The shape of a real batch, as the dispatcher sees it.

    ``all_decode`` is False when any request is still in its prompt; ``uniform_query_len`` is the
    common query length when every request has the same one, else None.
    """

    num_tokens: int
    num_reqs: int
    max_query_len: int
    all_decode: bool
    uniform_query_len: int | None = None

    @classmethod
    def from_query_lens(cls, query_lens: Iterable[int], *, all_decode: bool) -> BatchShape:
        """Build the shape of a batch whose requests have these query lengths."""
        lens = list(query_lens)
        if not lens or min(lens) < 1:
            raise ConfigError(f"a batch needs at least one request with >= 1 token; got {lens}")
        uniform = lens[0] if all(n == lens[0] for n in lens) else None
        return cls(sum(lens), len(lens), max(lens), all_decode, uniform)


class Dispatcher:
    """Picks the smallest captured graph that can hold a batch; None means run eagerly.

    Among compatible graphs the one with the fewest tokens wins; on a tie a uniform-decode graph
    beats a mixed one and FULL beats PIECEWISE (less work replayed outside the graph).
    """

    __slots__ = ("_mixed", "_mixed_tokens", "_uniform", "captured")

    def __init__(self, captured: Iterable[BatchDescriptor]) -> None:
        self.captured = list(dict.fromkeys(captured))
        if any(d.mode is CUDAGraphMode.NONE for d in self.captured):
            raise ConfigError("a captured graph cannot have mode NONE (that is eager execution)")
        # uniform_query_len -> (sorted request counts, descriptors in the same order)
        uniform: dict[int, list[BatchDescriptor]] = {}
        for d in self.captured:
            if d.uniform_query_len is not None:
                uniform.setdefault(d.uniform_query_len, []).append(d)
        self._uniform: dict[int, tuple[list[int], list[BatchDescriptor]]] = {}
        for q, ds in uniform.items():
            ds.sort(key=lambda d: (d.request_cap, _mode_rank(d.mode)))
            self._uniform[q] = ([d.request_cap for d in ds], ds)
        self._mixed = sorted(
            (d for d in self.captured if d.uniform_query_len is None),
            key=lambda d: (d.num_tokens, _mode_rank(d.mode), -d.request_cap),
        )
        self._mixed_tokens = [d.num_tokens for d in self._mixed]

    def dispatch(self, shape: BatchShape) -> BatchDescriptor | None:
        """The graph that serves ``shape``, or None (eager) when no captured graph fits."""
        best = self._dispatch_uniform(shape)
        i = bisect_left(self._mixed_tokens, shape.num_tokens)
        # NOTE: request caps are not monotonic in size for user-given descriptors, so scan from the
        # first large-enough size; with the default policy the first candidate already fits.
        for d in self._mixed[i:]:
            if best is not None and d.num_tokens >= best.num_tokens:
                break
            if d.request_cap >= shape.num_reqs:
                return d
        return best

    def _dispatch_uniform(self, shape: BatchShape) -> BatchDescriptor | None:
        if not shape.all_decode or shape.uniform_query_len is None:
            return None
        table = self._uniform.get(shape.uniform_query_len)
        if table is None:
            return None
        caps, ds = table
        i = bisect_left(caps, shape.num_reqs)
        return ds[i] if i < len(ds) else None


def _mode_rank(mode: CUDAGraphMode) -> int:
    return 0 if mode is CUDAGraphMode.FULL else 1
