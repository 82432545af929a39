"""Error types a user can act on.

Every error raised on purpose by warmcap derives from :class:`WarmcapError`; the CLI turns one into a
one-line message and exit code 2 instead of a traceback.
"""

from __future__ import annotations


class WarmcapError(Exception):
    """Base class: a problem the user can fix (the message says what, the value seen, what to do)."""


class ConfigError(WarmcapError, ValueError):
    """An invalid engine, cache, scheduler or speculative setting."""


class ModelLoadError(WarmcapError):
    """A model directory, config or checkpoint that cannot be loaded."""


class CapacityError(WarmcapError):
    """The KV pool cannot hold what was asked of it (too few blocks)."""


class NonFiniteLogitsError(WarmcapError):
    """A model produced NaN or infinite logits: its weights (or its dtype's range) are broken."""
