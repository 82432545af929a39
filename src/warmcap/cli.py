"""The ``warmup`` command."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

import typer
from rich.console import Console

from warmcap import __version__
from warmcap.errors import WarmcapError

app = typer.Typer(
    name="warmup",
    help="Plan, run and verify an LLM engine's start-up: warmup, KV-write audit, graph capture.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
EXIT_USAGE = 2


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a :class:`WarmcapError` into one red line and exit code 2 — never a traceback."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except WarmcapError as exc:
            err.print(f"[bold red]error:[/] {exc}", highlight=False)
            raise typer.Exit(EXIT_USAGE) from None

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"warmcap {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """warmcap: start-up you can trust."""


def main() -> None:
    """Console-script entry point."""
    sys.exit(app())
