"""Where warmcap keeps what it builds once per machine: ``$WARMCAP_CACHE`` (default
``~/.cache/warmcap``), holding the converted presets (``models/``), cached configs (``configs/``),
compiled CPU kernels (``kernels/``) and the start-up cache (``startup/``)."""

from __future__ import annotations

from pathlib import Path

from warmcap import env


def cache_dir() -> Path:
    """The warmcap cache folder: ``$WARMCAP_CACHE`` or ``~/.cache/warmcap``."""
    return Path(env.read("WARMCAP_CACHE") or Path.home() / ".cache" / "warmcap").expanduser()
