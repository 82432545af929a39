"""A progress bar for ``generate(..., use_tqdm=True)``: rich on a terminal, nothing elsewhere."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


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
