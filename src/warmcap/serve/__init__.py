"""``warmup serve``: an OpenAI-compatible server over one engine, ready only after an audited start-up."""

from __future__ import annotations

from warmcap.serve.app import ServeOptions, build_app

__all__ = ["ServeOptions", "build_app"]
