"""One record of start-up options (``config.StartupOptions``) with one set of defaults: ``LLM``,
``run_startup`` (``warmup run``), ``warmup serve`` and ``warmup generate`` show and take the same
ones, and the graph-verdict cache works the same in ``LLM``, ``warmup run`` and the server."""

from __future__ import annotations

import inspect
from dataclasses import fields
from typing import Any

import pytest
import typer

from warmcap.cli import generate, run, serve
from warmcap.config import STARTUP_OPTION_NAMES, StartupOptions
from warmcap.engine_args import build_config
from warmcap.errors import ConfigError
from warmcap.llm import LLM
from warmcap.serve.startup_facts import start_engine
from warmcap.startup import run_startup

#: a small engine that captures graphs (so there are verdicts to cache)
SMALL: dict[str, Any] = {
    "max_num_seqs": 2,
    "max_model_len": 128,
    "num_blocks": 32,
    "max_num_batched_tokens": 32,
}
SIZES = (1, 2)


@pytest.mark.parametrize("command", [run, serve, generate], ids=lambda c: c.__name__)
def test_every_command_shows_the_records_defaults(command) -> None:
    params = inspect.signature(command).parameters
    defaults = StartupOptions()
    for f in fields(StartupOptions):
        param = params[f.name]
        default = (
            param.default.default if isinstance(param.default, typer.models.OptionInfo) else param.default
        )
        if f.name == "capture_sizes":
            assert default is None  # the command line's text; None: the planner's ladder, as the record's
        else:
            assert default == getattr(defaults, f.name), (command.__name__, f.name)
    assert set(STARTUP_OPTION_NAMES) == {f.name for f in fields(StartupOptions)}


def _from_cache(engine) -> int:
    cache = engine.graph_startup.startup_cache
    return 0 if cache is None else cache.hits


def test_the_verdict_cache_works_the_same_in_llm_run_and_serve() -> None:
    """A second identical start reuses verdicts whichever door started the first: the cache is on
    by default for all of them and keyed the same way."""
    config = build_config("tiny-llama", **SMALL)
    options = StartupOptions(capture_sizes=SIZES)
    first = LLM("tiny-llama", capture_sizes=SIZES, **SMALL)
    assert _from_cache(first.engine) == 0
    first.shutdown()
    again = LLM("tiny-llama", startup=options, **SMALL)
    served = start_engine(config, options)
    ran = run_startup(config, options)
    try:
        for engine in (again.engine, served.engine, ran.engine):
            assert _from_cache(engine) > 0
        # ... and turning it off is the same switch everywhere.
        off = LLM("tiny-llama", capture_sizes=SIZES, startup_cache=False, **SMALL)
        assert off.engine.graph_startup.startup_cache is None
        off.shutdown()
    finally:
        for engine in (again.engine, served.engine, ran.engine):
            engine.shutdown()


def test_options_are_given_once_and_checked() -> None:
    with pytest.raises(ConfigError, match="either as startup=StartupOptions"):
        LLM("tiny-llama", startup=StartupOptions(), audit=False, **SMALL)
    with pytest.raises(ConfigError, match="unknown graph backend 'cudagraphs'"):
        StartupOptions(backend="cudagraphs")
    with pytest.raises(ConfigError, match="capture_sizes"):
        StartupOptions(capture_sizes=(0, 2))
    assert StartupOptions(capture_sizes=(4, 1, 4)).capture_sizes == (1, 4)
