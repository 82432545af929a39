"""Human and machine views of a ``warmup accept`` run: a rich table per check, or one JSON object."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

    from warmcap.accept.baseline import Comparison
    from warmcap.accept.harness import Measurement, PromptSet

_STYLE = {"PASS": "green", "FAIL": "bold red", "HIGH": "yellow"}


def accept_json(
    *,
    model: str,
    spec: dict[str, Any],
    prompt_set: PromptSet,
    max_tokens: int,
    measurement: Measurement,
    baseline_path: Path | None,
    comparison: Comparison | None,
) -> dict[str, Any]:
    """The ``--json`` document: what ran, what it measured, and each check (none when writing)."""
    return {
        "model": model,
        "spec": spec,
        "source": measurement.source,
        "prompt_set_sha256": prompt_set.sha256,
        "num_prompts": len(prompt_set.prompts),
        "max_tokens": max_tokens,
        "completion_tokens": measurement.completion_tokens,
        "measured": measurement.acceptance.as_dict(),
        "baseline": str(baseline_path) if baseline_path else None,
        "rtol": comparison.rtol if comparison else None,
        "checks": [c.to_json() for c in comparison.checks] if comparison else [],
        "passed": comparison.passed if comparison else True,
    }


def render_measurement(measurement: Measurement, console: Console) -> None:
    a = measurement.acceptance
    console.print(
        f"[bold]{measurement.source}[/]: {a.num_drafts} drafts, {a.num_accepted_tokens}/"
        f"{a.num_draft_tokens} draft tokens accepted, acceptance length {a.acceptance_length:.4f}, "
        f"{measurement.completion_tokens} tokens generated",
        highlight=False,
        soft_wrap=True,
    )


def render_comparison(comparison: Comparison, baseline_path: Path, console: Console) -> None:
    """One row per check (baseline, measured, delta, status), then the verdict."""
    table = Table(
        title=f"acceptance vs {baseline_path.name} (rtol {comparison.rtol:g})",
        title_justify="left",
        show_edge=False,
    )
    for col in ("check", "baseline", "measured", "delta", "status"):
        table.add_column(col, justify="left" if col in ("check", "status") else "right")
    for c in comparison.checks:
        style = _STYLE[c.status]
        table.add_row(
            c.name, f"{c.baseline:.4f}", f"{c.measured:.4f}", f"{c.delta:+.4f}", f"[{style}]{c.status}[/]"
        )
    console.print(table)
    failed = [c.name for c in comparison.checks if c.status == "FAIL"]
    high = [c.name for c in comparison.checks if c.status == "HIGH"]
    if failed:
        console.print(
            f"[bold red]FAIL:[/] acceptance regressed beyond {comparison.rtol:.0%} at: {', '.join(failed)}",
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print("[green]PASS[/]: acceptance within tolerance of the baseline", highlight=False)
    if high:
        console.print(
            f"[yellow]note:[/] acceptance rose beyond tolerance at: {', '.join(high)}; if that is "
            "intended, record it with --write-baseline",
            highlight=False,
            soft_wrap=True,
        )
