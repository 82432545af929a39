"""Start-up hooks: what they are given and how their results are named.

A hook runs once the engine's KV cache manager, scheduler and runner exist, before the first
request. It gets a :class:`StartupContext` (never the engine, so hooks need not import it) and
returns its result, which the engine keeps under :func:`hook_name` in ``startup_results``.

Start-up reports what it is doing as :class:`StartupEvent` s: each is logged on the ``warmcap``
logger and handed to a :data:`StartupObserver` (the CLI's progress display), so hooks report
progress without knowing how, or whether, it is shown.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from warmcap.config import EngineConfig
    from warmcap.core.kv_cache_manager import KVCacheManager
    from warmcap.core.kv_spec import KVCacheGroup
    from warmcap.runner_v2.model_runner import ModelRunner


logger = logging.getLogger("warmcap.startup")


@dataclass(frozen=True, slots=True)
class StartupEvent:
    """One thing start-up did: a phase began (no ``done``), advanced (``done`` of ``total``) or
    ended (``finished``, with its ``seconds``)."""

    #: ``load``, ``kv_sizing``, ``warmup``, ``graph_capture``, ``graph_verify``, ``smoke``, ...
    phase: str
    message: str = ""
    done: int | None = None
    total: int | None = None
    finished: bool = False
    seconds: float | None = None


#: ``observer(event)``; must be cheap and must not raise (it runs inside start-up)
StartupObserver = Callable[[StartupEvent], None]


def ignore_event(event: StartupEvent) -> None:
    """The observer that shows nothing (events are still logged)."""


_current_observer: ContextVar[StartupObserver] = ContextVar("warmcap_startup_observer", default=ignore_event)


@contextmanager
def observing(observer: StartupObserver) -> Iterator[StartupObserver]:
    """Engines started inside this block report to ``observer`` unless given their own (the CLI
    uses it so ``LLM(...)`` and the server need no extra argument)."""
    token = _current_observer.set(observer)
    try:
        yield observer
    finally:
        _current_observer.reset(token)


def current_observer() -> StartupObserver:
    """The observer set by the innermost :func:`observing` block (default: :func:`ignore_event`)."""
    return _current_observer.get()


def notify(observer: StartupObserver, event: StartupEvent) -> None:
    """Log ``event`` (phase starts and ends at INFO, steps at DEBUG) and hand it to ``observer``."""
    if event.finished:
        seconds = "" if event.seconds is None else f" in {event.seconds:.2f} s"
        logger.info("%s done%s%s", event.phase, seconds, f": {event.message}" if event.message else "")
    elif event.done is None:
        logger.info("%s: %s", event.phase, event.message or "started")
    else:
        logger.debug("%s %d/%s: %s", event.phase, event.done, event.total, event.message)
    observer(event)


@dataclass(frozen=True, slots=True)
class StartupContext:
    """The parts of a started engine a start-up hook may use."""

    config: EngineConfig
    device: torch.device
    kv_groups: list[KVCacheGroup]
    num_blocks: int
    kv_cache_manager: KVCacheManager
    runner: ModelRunner
    #: where hooks report progress (through :meth:`report`)
    observer: StartupObserver = field(default=ignore_event)

    def report(
        self,
        phase: str,
        message: str = "",
        *,
        done: int | None = None,
        total: int | None = None,
        finished: bool = False,
        seconds: float | None = None,
    ) -> None:
        """Log one start-up event and pass it to the observer (see :func:`notify`)."""
        notify(self.observer, StartupEvent(phase, message, done, total, finished, seconds))


#: ``hook(context) -> result`` (None when the hook had nothing to do)
StartupHook = Callable[[StartupContext], Any]


def hook_name(hook: StartupHook) -> str:
    """The name a hook's result is kept under: its function's name without a ``_hook`` suffix
    (``warmup_hook`` -> ``warmup``); a ``functools.partial`` is named after its function."""
    func = getattr(hook, "func", hook)
    name = getattr(func, "__name__", None) or type(func).__name__
    return name.removesuffix("_hook")
