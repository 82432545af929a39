"""Per-request sampling settings (the fields users of vLLM know)."""

from __future__ import annotations

from dataclasses import dataclass

from warmcap.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature=0`` is greedy."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0.0, f"temperature must be >= 0; got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables it); got {self.top_k}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1]; got {self.top_p}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1]; got {self.min_p}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1; got {self.max_tokens}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
