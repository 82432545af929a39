"""Write a page to a file: the CLI's one entry point into :mod:`warmcap.pages`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmcap.errors import WarmcapError
from warmcap.pages.diff_page import diff_page
from warmcap.pages.plan_page import plan_page, plan_view
from warmcap.pages.report_page import report_page
from warmcap.pages.run_detail import run_detail

if TYPE_CHECKING:
    from warmcap.graphs.capture.planning import CapturePlan
    from warmcap.warmup.plan import WarmupPlan
    from warmcap.warmup.run import WarmupResult


def write_page(path: str, html: str) -> None:
    try:
        Path(path).write_text(html, encoding="utf-8")
    except OSError as exc:
        raise WarmcapError(
            f"--html {path!r} cannot be written ({exc.strerror}): choose another path"
        ) from None


def write_plan_page(path: str, plan: WarmupPlan, capture: CapturePlan) -> None:
    """The plan's page with ``capture``, the graphs the capture planner plans for the same config
    (``graphs.capture.capturer.planned_capture``): listed, and each step looked up among them."""
    write_page(path, plan_page(plan_view(plan), capture))


def write_report_page(path: str, report: dict[str, Any], warmup: WarmupResult | None = None) -> None:
    """The report's page (``report``: its JSON dict); with the run's ``warmup`` result, the steps'
    block grids and what each pass wrote."""
    write_page(path, report_page(report, run_detail(warmup) if warmup is not None else None))


def write_diff_page(
    path: str, old: dict[str, Any], new: dict[str, Any], rows: list[dict[str, str]], names: tuple[str, str]
) -> None:
    write_page(path, diff_page(old, new, rows, names=names))
