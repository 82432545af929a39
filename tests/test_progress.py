"""Start-up a person can watch: every phase drawn in order on a terminal, redrawn while a phase is
silent, nothing drawn into a pipe, and each phase logged on the ``warmcap`` logger."""

from __future__ import annotations

import io
import logging
import re
import time

from rich.console import Console

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from warmcap.progress import PHASE_LABELS, StartupProgress, configure_logging
from warmcap.startup import run_startup
from warmcap.startup_hooks import StartupEvent

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PHASES = ["load", "kv_sizing", "warmup", "graph_capture", "graph_verify", "smoke"]


def _terminal(buffer: io.StringIO) -> Console:
    return Console(file=buffer, force_terminal=True, width=140, color_system=None)


def _tiny_config() -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="tiny-llama"),
        cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128),
    )


def test_warmup_run_draws_every_phase_in_order_and_logs_each(caplog):
    buffer = io.StringIO()
    events: list[StartupEvent] = []
    with caplog.at_level(logging.INFO, logger="warmcap"), StartupProgress(_terminal(buffer)) as progress:

        def observe(event: StartupEvent) -> None:
            events.append(event)
            progress(event)

        run = run_startup(_tiny_config(), observer=observe, capture_sizes=[1, 2])
    assert run.report.totals.all_verified

    # The last frame the terminal shows: one finished line per phase, in start-up order.
    text = ANSI.sub("", buffer.getvalue())
    final = text[text.rindex(PHASE_LABELS["load"]) :]
    positions = [final.index(PHASE_LABELS[p]) for p in PHASES]
    assert positions == sorted(positions), final
    assert f"verify graphs: {len(run.report.graphs)}/{len(run.report.graphs)} verified" in final

    # Steps advance within a phase: warmup counts its plan's steps, capture counts its graphs.
    warm = [e.done for e in events if e.phase == "warmup" and e.done is not None]
    assert warm == list(range(len(warm))) and warm[-1] == len(run.engine.warmup_result.plan.steps)
    captured = [e.done for e in events if e.phase == "graph_capture" and e.done is not None]
    assert captured[-1] == len(run.report.graphs)
    finished = [e.phase for e in events if e.finished]
    assert finished == ["load", "kv_sizing", "warmup", "graph_verify", "graph_capture", "smoke"]

    # The same phases reach the log (INFO), so a non-terminal run can follow them too.
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == "warmcap.startup")
    for phase in ("load done", "kv_sizing done", "warmup done", "graph_capture done", "smoke done"):
        assert phase in logged


def test_progress_redraws_while_a_phase_is_silent():
    """A long step (a big graph, a slow load) still moves the display: elapsed time within 2 s."""
    buffer = io.StringIO()
    with StartupProgress(_terminal(buffer)) as progress:
        progress(StartupEvent("load", "model x"))
        time.sleep(0.3)
        before = len(buffer.getvalue())
        time.sleep(2.2)
        grown = buffer.getvalue()[before:]
    assert "0:00:01" in ANSI.sub("", grown) or "0:00:02" in ANSI.sub("", grown)


def test_nothing_is_drawn_into_a_pipe():
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=False)
    with StartupProgress(console) as progress:
        progress(StartupEvent("load", "model x"))
        progress(StartupEvent("load", finished=True, seconds=0.1))
    assert not progress.enabled
    assert buffer.getvalue() == ""


def test_messages_are_shown_as_written_not_read_as_markup():
    buffer = io.StringIO()
    with StartupProgress(_terminal(buffer)) as progress:
        progress(StartupEvent("load", "/models/[bold]odd[/bold] name"))
        progress(StartupEvent("load", finished=True, seconds=0.1))
    assert "/models/[bold]odd[/bold] name" in ANSI.sub("", buffer.getvalue())


def test_a_later_command_is_not_chatty_because_an_earlier_one_was():
    """A server sets the start-up logger to INFO; a one-shot command run later in the same
    process (its default WARNING) must not keep printing those INFO lines."""
    out = io.StringIO()
    console = Console(file=out, width=200)
    configure_logging(console, logging.INFO, name="warmcap.startup")
    configure_logging(console, logging.WARNING)
    logging.getLogger("warmcap.startup").info("load: model x")
    logging.getLogger("warmcap.startup").warning("pool is small")
    assert "load: model x" not in out.getvalue()
    assert "pool is small" in out.getvalue()
