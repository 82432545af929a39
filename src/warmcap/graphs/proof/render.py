"""Render capture reports and report diffs with rich, for people reading a start-up log."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from warmcap.graphs.proof.diff import DiffResult
from warmcap.graphs.proof.report import AUDIT_OFF, CaptureReport, GraphRecord, RankRow

BACKEND_EXPLAINED = {
    "cuda": "CUDA graphs were recorded with torch.cuda.CUDAGraph into one shared memory pool and "
    "replayed on real batches padded to the captured sizes.",
    "static": "No CUDA graph was recorded on this machine. The 'static' backend runs the same "
    "capture and replay code over the same static input buffers; on CPU a small graph replays a "
    "recording of its forward's kernel calls (the notes say which), any other re-runs the eager "
    "forward on those buffers. It proves the padding and buffer handling (replay equals eager, "
    "padded rows never touch real rows); it says nothing about CUDA-graph speed or memory, which "
    "are shown as the size of the static output buffers (or of a recording's intermediates).",
    "compile": "Each shape was compiled with torch.compile over the static input buffers; no CUDA "
    "graph was recorded.",
    "eager": "No graph was captured (enforce_eager): every pass ran eagerly.",
}


def render(report: CaptureReport, console: Console) -> None:
    """Print the report: header, per-graph table, totals, warmup audit and spec-decode lines."""
    spec = f"{report.spec.method} k={report.spec.k}" if report.spec.method else "none"
    header = Text.assemble(
        ("model ", "bold"),
        report.model,
        ("   device ", "bold"),
        report.device,
        ("   backend ", "bold"),
        report.backend,
        ("   speculation ", "bold"),
        spec,
        ("   batch-invariant" if report.batch_invariant else "", "bold"),
        "\n",
        BACKEND_EXPLAINED[report.backend],
        "\n",
        ("capture sizes ", "bold"),
        _sizes(report.capture_sizes),
    )
    console.print(Panel(header, title="warmcap graph capture", expand=False))
    console.print(_graph_table(report.graphs, report.backend))

    t = report.totals
    ok = "[green]all verified[/]" if t.all_verified else "[red]NOT all verified[/]"
    console.print(f"[bold]totals[/]  {t.count} graphs, {t.seconds:.3f} s, {_mib(t.bytes)}, {ok}")
    _print_startup_cache(report, console)
    if not report.batch_invariant and any(g.real_rows_max_abs_diff for g in report.graphs):
        console.print(
            "[dim]real rows: small nonzero differences are float rounding (the unpadded batch has "
            "fewer rows: each row's queries are padded to another length, and oneDNN/MKL GEMMs sum by "
            "row count); --batch-invariant makes them match[/]"
        )
    _print_cuda_safety(report.graphs, console)

    a = report.warmup_audit
    verdict = "[green]no stray KV write[/]" if a.violations == 0 else f"[red]{a.violations} violations[/]"
    if not a.enabled:
        console.print(f"[bold]warmup audit[/]  [yellow]{AUDIT_OFF}[/]")
    else:
        console.print(
            f"[bold]warmup audit[/]  {a.steps} steps, {a.passes} passes, "
            f"{a.slots_checked} slots checked: {verdict}"
        )
    for sample in a.violation_samples:
        console.print(f"  [red]- {sample}[/]")
    if report.ranks:
        console.print(_rank_table(report.ranks))

    s = report.spec_decode
    if s.num_drafts:
        per_pos = ", ".join(str(n) for n in s.per_position) or "-"
        console.print(
            f"[bold]spec decode[/]  acceptance length {s.acceptance_length:.2f} "
            f"({s.num_accepted_tokens}/{s.num_draft_tokens} drafts accepted over {s.num_drafts} steps; "
            f"accepted per position: {per_pos})"
        )
    else:
        console.print("[bold]spec decode[/]  no drafts were verified")

    timings = [f"{k} {v:.2f}s" for k, v in report.timings.items() if v is not None]
    if timings:
        console.print("[bold]timings[/]  " + ", ".join(timings))
    for note in report.notes:
        console.print(f"[yellow]note:[/] {note}")


def _print_startup_cache(report: CaptureReport, console: Console) -> None:
    """Which verdicts were taken from the start-up cache rather than proven in this run (I4)."""
    use = report.startup_cache
    cached = [g.label for g in report.graphs if g.verified_source == "cache"]
    safety = [g.label for g in report.graphs if g.cuda_safe_source == "cache"]
    if use is not None and not use.enabled:
        console.print("[bold]start-up cache[/]  off: every verdict was proven in this run")
        return
    if use is not None and use.stale:
        console.print(
            f"[bold]start-up cache[/]  [yellow]stale[/] (a spot check disagreed): every graph was "
            f"verified in this run; entry rebuilt ({use.entry})",
            highlight=False,
        )
        return
    if not cached and not safety:
        if use is not None:
            console.print(
                f"[bold]start-up cache[/]  nothing taken: every verdict proven in this run, recorded in "
                f"{use.entry}",
                highlight=False,
            )
        return
    where = f" ({use.entry}, weights sha256 {(use.weights_digest or '?')[:16]})" if use is not None else ""
    console.print(
        f"[bold]start-up cache[/]  {len(cached)} of {len(report.graphs)} verdicts and {len(safety)} "
        f"CUDA-safety verdict(s) from the start-up cache{where}, not proven in this run; one graph per "
        "phase was verified again (the table's 'proof' column names them). --no-startup-cache "
        "proves all.",
        highlight=False,
    )


def _rank_table(ranks: list[RankRow]) -> Table:
    """Tensor parallelism: each rank's own warmup audit and graph verification, and one verdict."""
    verdict = "all ranks clean" if all(r.ok for r in ranks) else "NOT every rank clean"
    table = Table(title=f"tensor-parallel ranks: {verdict}", title_justify="left")
    for col in ("rank", "audit slots", "stray writes", "graphs verified"):
        table.add_column(col, justify="right")
    for r in ranks:
        a = r.warmup_audit
        stray = Text(str(a.violations), style="green" if a.violations == 0 else "red")
        if not a.enabled:
            stray = Text("audit off", style="yellow")
        verified = Text(f"{r.graphs_verified}/{r.graphs}", style="green" if r.all_verified else "red")
        table.add_row(str(r.rank), str(a.slots_checked) if a.enabled else "-", stray, verified)
    return table


def _print_cuda_safety(graphs: list[GraphRecord], console: Console) -> None:
    """One line on whether the checked graphs would record under CUDA, and why not where not."""
    checked = [g for g in graphs if g.cuda_safe is not None]
    if not checked:
        return
    unsafe = [g for g in checked if not g.cuda_safe]
    verdict = "[green]all would record[/]" if not unsafe else f"[red]{len(unsafe)} would not record[/]"
    console.print(
        f"[bold]CUDA-safe[/]  {len(checked)} graph(s) checked on CPU with fake tensors "
        f"(the largest of each phase): {verdict}"
    )

    for g in unsafe:
        console.print(f"  [red]- {g.label}: {g.cuda_unsafe_reason}[/]", highlight=False)


def _graph_table(graphs: list[GraphRecord], backend: str) -> Table:
    memory_title = "buffer" if backend == "static" else "memory"
    table = Table(
        title="graphs in capture order (largest first). shape: tokens/requests/query length; "
        "vs eager: |replay - eager| on the same padded inputs; real rows: vs the unpadded batch",
        title_justify="left",
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    for name, justify in (
        ("phase", "left"),
        ("mode", "left"),
        ("shape", "left"),
        ("capture", "right"),
        (memory_title, "right"),
        ("vs eager", "right"),
        ("real rows", "right"),
        ("greedy", "center"),
        ("ok", "center"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)
    # Only when the start-up cache gave any verdict: where each came from.
    sources = any(g.verified_source == "cache" or g.cuda_safe_source == "cache" for g in graphs)
    if sources:
        table.add_column("proof", justify="left", no_wrap=True)
    for g in graphs:
        proof = [_source(g)] if sources else []
        table.add_row(
            g.phase,
            g.mode,
            f"{g.num_tokens}/{_opt(g.num_reqs)}/{_opt(g.uniform_query_len)}",
            f"{g.capture_seconds:.2f}s",
            _mib(g.memory_bytes),
            _diff(g.max_abs_diff),
            _diff(g.real_rows_max_abs_diff),
            _yes_no(g.greedy_match),
            _yes_no(g.verified),
            *proof,
        )
    return table


def _source(g: GraphRecord) -> Text:
    """``run`` or ``cache`` for the replay-vs-eager verdict, and the CUDA-safety one where checked."""
    text = g.verified_source
    if g.cuda_safe is not None:
        text += f", cuda-safe {g.cuda_safe_source}"
    return Text(text, style="yellow" if "cache" in text else "dim")


def render_diff(result: DiffResult, console: Console) -> None:
    """Print a diff table (regressions first) and a one-line verdict."""
    table = Table(title="capture report diff")
    for name in ("metric", "old", "new", "status"):
        table.add_column(name)
    order = {"regression": 0, "improvement": 1, "same": 2}
    style = {"regression": "red", "improvement": "green", "same": "dim"}
    for row in sorted(result.rows, key=lambda r: order[r.status]):
        table.add_row(row.metric, row.old, row.new, Text(row.status, style=style[row.status]))
    verdict = (
        Text(f"{len(result.regressions)} regression(s)", style="bold red")
        if result.has_regressions
        else Text("no regressions", style="bold green")
    )
    console.print(Group(table, verdict))


def _sizes(sizes: list[int]) -> str:
    return ", ".join(str(s) for s in sizes) if sizes else "-"


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _diff(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _yes_no(value: bool | None) -> Text:
    if value is None:
        return Text("-", style="dim")
    return Text("yes", style="green") if value else Text("NO", style="bold red")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
