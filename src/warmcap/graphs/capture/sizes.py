"""Capture-size policy: which token counts get a graph, and how a batch is padded to one.

Pure functions (no torch) so the policy is tested on any machine.

Default ladder: 1, 2, 4, then every multiple of 8 below 256, then every multiple of 16 from 256, up
to the cap ``min(2 * max_num_seqs * (1 + k), 512)`` (the bound vLLM uses by default).
**The cap itself is always captured**, even when it is not on the ladder: vLLM drops such a cap, so
the largest batches a full uniform-decode step can produce may fall back to eager; warmcap adds
the one extra graph so that every batch up to the declared maximum is served by a graph.

Profile-guided sizes: given a histogram of observed token counts, :func:`choose_sizes` picks at most
``budget`` sizes that minimise the expected padded tokens per batch (exact dynamic programme whose
candidates are the observed counts themselves: a size between two observed counts only adds padding).

Histogram file format (:func:`load_histogram`), JSON lines, blank lines ignored, one of per line:

- ``{"num_tokens": 24, "count": 130}`` -- 130 batches of 24 tokens (``count`` defaults to 1);
- ``24`` -- one batch of 24 tokens (e.g. one line per step from a serving log).
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from warmcap.errors import ConfigError

LADDER_FINE_LIMIT = 256
LADDER_MAX = 512


def default_capture_sizes(
    max_num_seqs: int, num_speculative_tokens: int, *, max_size: int | None = None
) -> list[int]:
    """The default ladder up to ``max_size`` (default ``min(2 * max_num_seqs * (1 + k), 512)``).

    The cap is included even when it is off the ladder (see the module docstring).
    """
    if max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs must be >= 1 to size CUDA graphs; got {max_num_seqs}")
    if num_speculative_tokens < 0:
        raise ConfigError(f"num_speculative_tokens must be >= 0; got {num_speculative_tokens}")
    cap = min(2 * max_num_seqs * (1 + num_speculative_tokens), LADDER_MAX)
    if max_size is not None:
        if max_size < 1:
            raise ConfigError(f"max capture size must be >= 1; got {max_size}")
        cap = max_size
    ladder = [1, 2, 4, *range(8, LADDER_FINE_LIMIT, 8), *range(LADDER_FINE_LIMIT, cap + 1, 16)]
    sizes = [s for s in ladder if s <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def uniform_decode_sizes(max_num_seqs: int, num_speculative_tokens: int) -> list[int]:
    """Token counts of uniform-decode graphs: ``(1 + k) * n`` for every ``n`` in ``1..max_num_seqs``.

    No holes: a decode step of ``n`` requests always has a graph of exactly its size.
    """
    if max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs must be >= 1 to size CUDA graphs; got {max_num_seqs}")
    if num_speculative_tokens < 0:
        raise ConfigError(f"num_speculative_tokens must be >= 0; got {num_speculative_tokens}")
    q = 1 + num_speculative_tokens
    return [q * n for n in range(1, max_num_seqs + 1)]


def parse_capture_sizes(text: str) -> list[int]:
    """Parse ``"1,2,4,8"`` (spaces allowed) into sorted unique sizes; duplicates are merged."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise ConfigError("capture sizes are empty: pass a comma-separated list such as 1,2,4,8")
    sizes: set[int] = set()
    for part in parts:
        if not part:
            raise ConfigError(f"capture sizes {text!r} contain an empty entry: remove the extra comma")
        try:
            value = int(part)
        except ValueError:
            raise ConfigError(
                f"capture size {part!r} in {text!r} is not an integer: use token counts like 1,2,4,8"
            ) from None
        if value < 1:
            raise ConfigError(f"capture size {value} in {text!r} must be >= 1 (a graph needs a token)")
        sizes.add(value)
    return sorted(sizes)


class PaddingTable:
    """Maps a batch's token count to the smallest captured size that holds it (built once)."""

    __slots__ = ("_sizes",)

    def __init__(self, sizes: Iterable[int]) -> None:
        self._sizes = sorted(set(sizes))
        if self._sizes and self._sizes[0] < 1:
            raise ConfigError(f"capture sizes must be >= 1; got {self._sizes[0]}")

    @property
    def sizes(self) -> list[int]:
        """The sorted unique sizes."""
        return list(self._sizes)

    @property
    def max_size(self) -> int:
        """The largest size (0 when empty)."""
        return self._sizes[-1] if self._sizes else 0

    def pad(self, num_tokens: int) -> int | None:
        """Smallest size >= ``num_tokens``; None when the batch is larger than every size (eager)."""
        i = bisect_left(self._sizes, num_tokens)
        return self._sizes[i] if i < len(self._sizes) else None


# --- profile-guided sizes --------------------------------------------------------------------


def load_histogram(path: str | Path) -> dict[int, int]:
    """Read a token-count histogram (JSON lines, format in the module docstring)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read histogram {path}: {exc.strerror}") from None
    hist: dict[int, int] = {}
    for lineno, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line:
            continue
        where = f"{path}:{lineno}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(
                f'{where}: {line!r} is not JSON: write {{"num_tokens": N, "count": C}} or N'
            ) from None
        if isinstance(item, dict):
            n, count = item.get("num_tokens"), item.get("count", 1)
        else:
            n, count = item, 1
        if not _is_int(n) or n < 1:
            raise ConfigError(f"{where}: num_tokens must be an integer >= 1; got {n!r}")
        if not _is_int(count) or count < 0:
            raise ConfigError(f"{where}: count must be an integer >= 0; got {count!r}")
        hist[n] = hist.get(n, 0) + count
    hist = {n: c for n, c in sorted(hist.items()) if c > 0}
    if not hist:
        raise ConfigError(f"histogram {path} has no batches: it needs at least one positive count")
    return hist


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class PaddingWaste:
    """Padding cost of a size set on a histogram.

    ``padded_tokens_per_batch``: expected padded tokens per batch (an eager batch pads nothing);
    ``fraction``: padded / (real + padded) tokens over graph-served batches;
    ``eager_fraction``: share of batches larger than every size (they run eagerly).
    """

    padded_tokens_per_batch: float
    fraction: float
    eager_fraction: float


def padding_waste(histogram: Mapping[int, int], sizes: Iterable[int]) -> PaddingWaste:
    """Expected padding when each batch is padded to the smallest size that holds it."""
    table = PaddingTable(sizes)
    total = padded = real = eager = 0
    for n, count in histogram.items():
        total += count
        size = table.pad(n)
        if size is None:
            eager += count
            continue
        padded += (size - n) * count
        real += n * count
    if total == 0:
        return PaddingWaste(0.0, 0.0, 0.0)
    served = real + padded
    return PaddingWaste(padded / total, padded / served if served else 0.0, eager / total)


def choose_sizes(
    histogram: Mapping[int, int],
    budget: int,
    *,
    must_include_max: bool = True,
    eager_token_cost: float = 1.0,
) -> list[int]:
    """At most ``budget`` sizes minimising expected padded tokens per batch (exact DP).

    With ``must_include_max`` the largest observed count is captured, so every observed batch gets a
    graph. Without it the top of the histogram may be left eager; an eager batch then costs
    ``eager_token_cost`` per token (1.0: an eager token weighs as much as a padded one), otherwise
    capturing nothing would trivially "waste" nothing. O(n^2 * budget) for n distinct counts.
    """
    if budget < 1:
        raise ConfigError(f"graph budget must be >= 1; got {budget}")
    items = sorted((n, c) for n, c in histogram.items() if c > 0)
    if not items:
        raise ConfigError("histogram has no batches: it needs at least one positive count")
    if items[0][0] < 1:
        raise ConfigError(f"histogram token counts must be >= 1; got {items[0][0]}")
    values = [n for n, _ in items]
    # Prefix sums: W[j] = batches among the first j counts, S[j] = their tokens.
    w_pre, s_pre = [0], [0]
    for n, c in items:
        w_pre.append(w_pre[-1] + c)
        s_pre.append(s_pre[-1] + n * c)
    m = len(values)

    def seg(i: int, j: int) -> int:
        # Padding of counts i..j-1 (0-based, half-open) when all are padded up to values[j-1].
        return values[j - 1] * (w_pre[j] - w_pre[i]) - (s_pre[j] - s_pre[i])

    inf = float("inf")
    # cost[j]: best padding of the first j counts with the current number of sizes, the last size
    # being values[j-1]; parent[b][j] the start of that last segment.
    cost: list[float] = [inf] + [float(seg(0, j)) for j in range(1, m + 1)]
    parents: list[list[int]] = [[0] * (m + 1)]
    best = (_finish(cost, m, s_pre, must_include_max, eager_token_cost), 0)
    for b in range(1, min(budget, m)):
        nxt: list[float] = [inf] * (m + 1)
        par = [0] * (m + 1)
        for j in range(b + 1, m + 1):
            best_i, best_v = 0, inf
            for i in range(b, j):
                v = cost[i] + seg(i, j)
                if v < best_v:
                    best_i, best_v = i, v
            nxt[j], par[j] = best_v, best_i
        cost = nxt
        parents.append(par)
        candidate = _finish(cost, m, s_pre, must_include_max, eager_token_cost)
        if candidate[0] < best[0][0]:
            best = (candidate, b)
    (_, end), b = best
    if end == 0:
        return []
    sizes: list[int] = []
    j = end
    for level in range(b, -1, -1):
        sizes.append(values[j - 1])
        j = parents[level][j]
    return sorted(sizes)


def _finish(
    cost: list[float], m: int, s_pre: list[int], must_include_max: bool, eager_token_cost: float
) -> tuple[float, int]:
    """Best total (padding + eager cost) over where the last size ends; returns (value, end)."""
    if must_include_max:
        return cost[m], m
    best = (eager_token_cost * s_pre[m], 0)
    for j in range(1, m + 1):
        v = cost[j] + eager_token_cost * (s_pre[m] - s_pre[j])
        if v < best[0]:
            best = (v, j)
    return best


@dataclass(frozen=True, slots=True)
class SizeComparison:
    """Default ladder vs profile-guided sizes with the same number of graphs."""

    ladder: list[int]
    chosen: list[int]
    ladder_waste: PaddingWaste
    chosen_waste: PaddingWaste

    @property
    def saved_tokens_per_batch(self) -> float:
        """Padded tokens per batch the chosen sizes save over the ladder (negative: worse)."""
        return self.ladder_waste.padded_tokens_per_batch - self.chosen_waste.padded_tokens_per_batch


def compare_with_ladder(
    histogram: Mapping[int, int], ladder: Iterable[int], *, budget: int | None = None
) -> SizeComparison:
    """Compare ``ladder`` with :func:`choose_sizes` given ``budget`` graphs (default: as many as the
    ladder spends up to its first size that holds the largest observed batch)."""
    ladder = sorted(set(ladder))
    if budget is None:
        table = PaddingTable(ladder)
        top = table.pad(max(histogram))
        budget = len(ladder) if top is None else bisect_left(ladder, top) + 1
    chosen = choose_sizes(histogram, budget)
    return SizeComparison(ladder, chosen, padding_waste(histogram, ladder), padding_waste(histogram, chosen))
