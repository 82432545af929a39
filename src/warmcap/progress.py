"""What a person watches while warmcap works: a bar for ``generate(..., use_tqdm=True)`` and the
start-up display (one line per phase with its step count and elapsed time), both drawn with rich
on stderr and only on a terminal; :func:`configure_logging` routes the ``warmcap`` logger there too.

Start-up reports :class:`~warmcap.startup_hooks.StartupEvent` s; :class:`StartupProgress` is the
observer that draws them, so hooks never import rich.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

    from warmcap.startup_hooks import StartupEvent

#: how the phases are named on screen
PHASE_LABELS = {
    "load": "load weights",
    "kv_sizing": "size KV cache",
    "warmup": "warmup (audited)",
    "graph_capture": "capture graphs",
    "graph_verify": "verify graphs",
    "smoke": "smoke generation",
}
#: redraws per second: the elapsed time moves even while one long step runs (at least every 2 s)
REFRESH_PER_SECOND = 2


@contextmanager
def progress_bar(
    total: int, *, enabled: bool, description: str = "Generating"
) -> Iterator[Callable[[], None]]:
    """Yields ``advance()``; draws a bar on stderr only when ``enabled`` and stderr is a terminal,
    so logs and pipes never receive control codes."""
    if not enabled or not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda: progress.advance(task)


class StartupProgress:
    """A start-up observer drawing one line per phase: spinner, label and last message, steps
    done of total, elapsed time. Draws only when ``console`` is a terminal (a pipe or a log file
    gets nothing); use as a context manager around the start-up."""

    def __init__(self, console: Console, *, enabled: bool = True) -> None:
        from rich.progress import (
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.enabled = enabled and console.is_terminal
        self._progress: Progress = Progress(
            SpinnerColumn(finished_text="[green]✓"),
            TextColumn("{task.description}"),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            refresh_per_second=REFRESH_PER_SECOND,
            disable=not self.enabled,
        )
        self._tasks: dict[str, TaskID] = {}
        self._described: dict[str, str] = {}
        self._totals: dict[str, int] = {}

    def __enter__(self) -> StartupProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def __call__(self, event: StartupEvent) -> None:
        if not self.enabled:
            return
        from rich.markup import escape

        label = PHASE_LABELS.get(event.phase, event.phase)
        # A finished line keeps its last message unless the event brings a summary; messages are
        # escaped (a path or a graph label may hold "[...]", which rich would read as markup).
        if event.message or event.phase not in self._described:
            self._described[event.phase] = f"{label}: {escape(event.message)}" if event.message else label
        description = self._described[event.phase]
        task = self._tasks.get(event.phase)
        if task is None:
            task = self._tasks[event.phase] = self._progress.add_task(description, total=None)
        if event.finished:
            total = self._totals.get(event.phase) or 1
            seconds = "" if event.seconds is None else f" [dim]({event.seconds:.1f} s)[/]"
            self._progress.update(task, description=description + seconds, total=total, completed=total)
            self._progress.stop_task(task)
            return
        if event.total is not None:
            self._totals[event.phase] = event.total
        self._progress.update(
            task, description=description, total=self._totals.get(event.phase), completed=event.done or 0
        )


def log_level(*, quiet: bool = False, verbose: bool = False, default: int = logging.WARNING) -> int:
    """``--quiet``: errors only; ``--verbose``: one level more than ``default`` (INFO for the CLI's
    WARNING: phase by phase; DEBUG for a server's INFO: step by step)."""
    if quiet:
        return logging.ERROR
    return max(logging.DEBUG, default - 10) if verbose else default


def configure_logging(console: Console, level: int, *, name: str = "warmcap") -> None:
    """Send logger ``name`` (default: all of warmcap) to ``console`` at ``level``. Idempotent: a
    call first removes what earlier calls installed on any warmcap logger (one process may run
    several commands, e.g. a server then a one-shot ``generate``), so only this call's handler
    and level apply."""
    from rich.logging import RichHandler

    for logger_name in ["warmcap", *logging.root.manager.loggerDict]:
        if logger_name != "warmcap" and not logger_name.startswith("warmcap."):
            continue
        earlier = logging.getLogger(logger_name)
        cli_handlers = [h for h in earlier.handlers if getattr(h, "_warmcap_cli", False)]
        for handler in cli_handlers:
            earlier.removeHandler(handler)
        if cli_handlers:
            earlier.setLevel(logging.NOTSET)
    log = logging.getLogger(name)
    handler = RichHandler(console=console, show_path=False, markup=False, rich_tracebacks=False)
    handler._warmcap_cli = True  # type: ignore[attr-defined]
    handler.setLevel(level)
    log.addHandler(handler)
    log.setLevel(level)
