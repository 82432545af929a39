"""``warmup run --html`` / ``warmup report FILE --html``: the capture report as a page.

Built from ``CaptureReport.to_dict()`` (the JSON ``warmup run --out`` writes). A run also hands
over :func:`warmcap.pages.run_detail.run_detail`, and the page then draws the warmup steps' block
grids with what each audited pass wrote and where any stray write landed.
"""

from __future__ import annotations

from typing import Any

from warmcap.pages.html import document, esc, legend, mib, num, sci, seconds, yes_no
from warmcap.pages.plan_page import plan_steps, plan_summary
from warmcap.pages.run_detail import overlays
from warmcap.pages.shapes import label_of

#: start-up phases in the order they run (the report's ``timings`` keys)
PHASE_COLOURS = {
    "load": "#748ffc",
    "kv_sizing": "#63e6be",
    "warmup": "#ffa94d",
    "capture": "#4c6ef5",
    "verify": "#be4bdb",
    "smoke": "#69db7c",
}
_WIDTH = 760
#: room for the timeline's row labels
_LABEL = 64


def header(report: dict[str, Any]) -> str:
    spec = report["spec"]
    spec_text = f"{spec['method']} k={spec['k']}" if spec["method"] else "none"
    t, a = report["totals"], report["warmup_audit"]
    verdict = (
        '<span class="badge ok">all graphs verified</span>'
        if t["all_verified"]
        else '<span class="badge fail">NOT all graphs verified</span>'
    )
    audit = (
        '<span class="badge ok">warmup audit clean</span>'
        if a["violations"] == 0
        else f'<span class="badge fail">{num(str(a["violations"]), "warmup_audit/violations")} stray KV write(s)</span>'
    )
    sizes = ", ".join(str(s) for s in report["capture_sizes"]) or "-"
    return (
        f'<p class="meta"><b>model</b> {esc(report["model"])} · <b>device</b> {esc(report["device"])} · '
        f"<b>backend</b> {esc(report['backend'])} · <b>speculation</b> {esc(spec_text)}"
        f"{' · <b>batch-invariant</b>' if report['batch_invariant'] else ''} · "
        f"<b>capture sizes</b> {esc(sizes)}</p><p>{verdict}{audit}</p>"
    )


def timeline(report: dict[str, Any], detail: dict[str, Any] | None) -> str:
    """One bar of the start-up phases in order; below it the warmup's own phases (with a run) and
    each graph's capture, on the same scale."""
    timings = report["timings"]
    phases = [(k, v) for k, v in timings.items() if v is not None]
    total = sum(v for _, v in phases) or 1.0
    scale = (_WIDTH - _LABEL) / total
    rects, x, starts = ['<text x="0" y="15">start-up</text>'], float(_LABEL), {}
    for name, v in phases:
        w = v * scale
        starts[name] = x
        rects.append(
            f'<rect x="{x:.1f}" y="0" width="{max(w, 1):.1f}" height="22" fill="{PHASE_COLOURS[name]}">'
            f"<title>{name}: {v:.3f} s</title></rect>"
        )
        if w > 60:
            rects.append(f'<text x="{x + 4:.1f}" y="15">{name} {v:.2f} s</text>')
        x += w
    rows = 1
    if detail is not None and "warmup" in starts:
        rects.append(f'<text x="0" y="{26 * rows + 14}">warmup</text>')
        rects.append(_sub_row(starts["warmup"], 26 * rows, list(detail["seconds"].items()), scale, "#ffd8a8"))
        rows += 1
    if "capture" in starts and report["graphs"]:
        segs = [(label_of(g), g["capture_seconds"]) for g in report["graphs"]]
        rects.append(f'<text x="0" y="{26 * rows + 14}">captures</text>')
        rects.append(_sub_row(starts["capture"], 26 * rows, segs, scale, "#bac8ff"))
        rows += 1
    table = "".join(
        f'<tr><td><span style="display:inline-block;width:10px;height:10px;'
        f'background:{PHASE_COLOURS[k]}"></span> {k}</td>'
        f'<td class="num">{num(seconds(v), f"timings/{k}") if v is not None else "-"}</td></tr>'
        for k, v in timings.items()
    )
    svg = (
        f'<svg width="{_WIDTH}" height="{26 * rows}" role="img" aria-label="start-up timeline">'
        f"{''.join(rects)}</svg>"
    )
    return f'<div class="cols" style="align-items:flex-start"><div style="flex:0 0 auto">{svg}</div><table><tr><th>phase</th><th>time</th></tr>{table}</table></div>'


def _sub_row(x0: float, y: int, segs: list[tuple[str, float]], scale: float, fill: str) -> str:
    out, x = [], x0
    for label, v in segs:
        w = v * scale
        out.append(
            f'<rect x="{x:.1f}" y="{y}" width="{max(w, 1):.1f}" height="20" fill="{fill}" stroke="#fff">'
            f"<title>{esc(label)}: {v:.3f} s</title></rect>"
        )
        if w > 6 * len(label):
            out.append(f'<text x="{x + 3:.1f}" y="{y + 14}">{esc(label)}</text>')
        x += w
    return "".join(out)


def graph_table(report: dict[str, Any]) -> str:
    """A row per graph, capture order: time and memory as bars, the verification numbers, verdict."""
    graphs = report["graphs"]
    if not graphs:
        return '<p class="dim">no graphs were captured</p>'
    most_s = max(g["capture_seconds"] for g in graphs) or 1.0
    most_b = max(g["memory_bytes"] for g in graphs) or 1
    memory = "buffer" if report["backend"] == "static" else "memory"
    rows = []
    for i, g in enumerate(graphs):
        p = f"graphs/{i}"
        safe = g["cuda_safe"]
        rows.append(
            f'<tr class="{"" if g["verified"] else "regression"}"><td>{esc(g["phase"])}</td><td>{esc(g["mode"])}</td>'
            f"<td>{g['num_tokens']}/{_opt(g['num_reqs'])}/{_opt(g['uniform_query_len'])}</td>"
            f'<td><span class="bar" style="width:{80 * g["capture_seconds"] / most_s:.0f}px"></span>'
            f"{num(seconds(g['capture_seconds']), p + '/capture_seconds')}</td>"
            f'<td><span class="bar mem" style="width:{80 * g["memory_bytes"] / most_b:.0f}px"></span>'
            f"{num(mib(g['memory_bytes']), p + '/memory_bytes')}</td>"
            f'<td class="num">{_opt_num(g["max_abs_diff"], p + "/max_abs_diff")}</td>'
            f'<td class="num">{_opt_num(g["real_rows_max_abs_diff"], p + "/real_rows_max_abs_diff")}</td>'
            f"<td>{yes_no(g['greedy_match'])}</td><td>{yes_no(g['verified'])}</td>"
            f"<td>{esc(g['verified_source'])}</td>"
            f'<td title="{esc(g["cuda_unsafe_reason"])}">{yes_no(safe)}</td></tr>'
        )
    t = report["totals"]
    cached = sum(g["verified_source"] == "cache" for g in graphs)
    return (
        "<table><tr><th>phase</th><th>mode</th><th>shape t/r/q</th><th>capture</th>"
        f"<th>{memory}</th><th>|replay − eager|</th><th>real rows</th>"
        "<th title='greedy tokens of replay equal eager&#39;s'>greedy</th><th>verified</th>"
        "<th title='run: checked in this start-up; cache: the start-up cache'>source</th><th>CUDA-safe</th></tr>"
        f"{''.join(rows)}</table>"
        f"<p><b>totals</b> {num(str(t['count']), 'totals/count')} graphs, "
        f"{num(seconds(t['seconds']), 'totals/seconds')}, {num(mib(t['bytes']), 'totals/bytes')}"
        + (
            f" · {cached} verdict(s) from the start-up cache (one graph per phase verified in this run)"
            if cached
            else ""
        )
        + "</p>"
    )


def audit_section(report: dict[str, Any], detail: dict[str, Any] | None) -> str:
    a = report["warmup_audit"]
    out = [
        f"<p>{num(str(a['steps']), 'warmup_audit/steps')} steps, {num(str(a['passes']), 'warmup_audit/passes')} "
        f"passes, {num(str(a['slots_checked']), 'warmup_audit/slots_checked')} slots checked: "
        + (
            '<span class="ok">no stray KV write</span>'
            if a["violations"] == 0
            else f'<span class="fail">{num(str(a["violations"]), "warmup_audit/violations")} stray KV write(s)</span>'
        )
        + "</p>"
    ]
    drawn = detail["violations"] if detail else []
    items = []
    for i, sample in enumerate(a["violation_samples"]):
        link = f' <a href="#cell-v{i}">→ cell on the grid</a>' if i < len(drawn) else ""
        items.append(
            f'<li id="v{i}"><span data-json="warmup_audit/violation_samples/{i}">{esc(sample)}</span>{link}</li>'
        )
    for v in drawn[len(a["violation_samples"]) :]:
        items.append(
            f'<li id="v{v["index"]}">{esc(v["text"])} <a href="#cell-v{v["index"]}">→ cell on the grid</a></li>'
        )
    if items:
        out.append(f'<ol class="samples" start="0">{"".join(items)}</ol>')
    if detail is None:
        out.append(
            '<p class="dim">This page was made from a saved report: the block grids of the warmup steps, '
            "what each pass wrote and where a stray write landed need the run itself (<code>warmup run --html</code>).</p>"
        )
        return "".join(out)
    if not detail["passes"]:
        out.append(
            '<p class="dim">the audit was off (<code>--no-audit</code>): no pass writes were recorded</p>'
        )
    else:
        out.append(_pass_chart(detail))
    return "".join(out)


def _pass_chart(detail: dict[str, Any]) -> str:
    """Slots each audited pass wrote, per step: a bar per pass (phase and KV group)."""
    steps = detail["plan"]["steps"]
    most = max((p["slots"] for ps in detail["passes"] for p in ps), default=1) or 1
    bad = {v["step"] for v in detail["violations"]}
    rows = []
    for i, passes in enumerate(detail["passes"]):
        name = steps[i]["name"]
        bars = "".join(
            f'<span title="{esc(p["phase"])} · {esc(p["group"])}: {p["slots"]} slots" '
            f'style="display:inline-block;margin-right:2px"><span class="bar" style="width:{max(2, 60 * p["slots"] / most):.0f}px;'
            f'background:{"#4c6ef5" if p["phase"] == "target" else "#f08c00"}"></span>'
            f'<span class="dim">{p["slots"]}</span></span>'
            for p in passes
        )
        cls = ' class="regression"' if name in bad else ""
        rows.append(
            f'<tr{cls}><td><a href="#step-{i}">{i}: {esc(name)}</a></td><td class="num">{len(passes)}</td><td>{bars}</td></tr>'
        )
    return (
        '<h3>slots per pass</h3><p class="dim">one bar per audited pass and KV group, in pass order: '
        '<span class="bar" style="width:12px"></span>target model, '
        '<span class="bar" style="width:12px;background:#f08c00"></span>drafter</p>'
        f"<table><tr><th>step</th><th>passes</th><th>slots written per pass</th></tr>{''.join(rows)}</table>"
    )


def acceptance_chart(report: dict[str, Any]) -> str:
    s = report["spec_decode"]
    if not s["num_drafts"]:
        return '<p class="dim">no drafts were verified in the smoke run</p>'
    per = s["per_position"]
    bar_w, h = 48, 120
    bars = []
    for i, n in enumerate(per):
        rate = n / s["num_drafts"]
        x, bh = 40 + i * (bar_w + 12), rate * h
        bars.append(
            f'<rect x="{x}" y="{h - bh + 10:.1f}" width="{bar_w}" height="{bh:.1f}" fill="#f08c00">'
            f"<title>position {i}: {n} of {s['num_drafts']} drafts accepted</title></rect>"
            f'<text x="{x}" y="{h + 24}">pos {i}</text>'
            f'<text x="{x + 4}" y="{h - bh + 24 if bh > 20 else h + 6:.1f}">{rate:.0%}</text>'
        )
    width = 40 + len(per) * (bar_w + 12)
    counts = ", ".join(num(str(n), f"spec_decode/per_position/{i}") for i, n in enumerate(per))
    return (
        f'<svg width="{width}" height="{h + 30}" role="img" aria-label="acceptance per position">'
        f'<line x1="36" y1="10" x2="36" y2="{h + 10}" stroke="#868e96"/>'
        f'<text x="0" y="16">100%</text><text x="8" y="{h + 10}">0%</text>{"".join(bars)}</svg>'
        f"<p>acceptance length <b>{num(format(s['acceptance_length'], '.2f'), 'spec_decode/acceptance_length')}</b> "
        f"({num(str(s['num_accepted_tokens']), 'spec_decode/num_accepted_tokens')} of "
        f"{num(str(s['num_draft_tokens']), 'spec_decode/num_draft_tokens')} draft tokens accepted over "
        f"{num(str(s['num_drafts']), 'spec_decode/num_drafts')} drafts; accepted per position: {counts})</p>"
    )


def _ranks(report: dict[str, Any]) -> str:
    ranks = report.get("ranks") or []
    if not ranks:
        return ""
    rows = "".join(
        f'<tr><td>{r["rank"]}</td><td class="num">{r["warmup_audit"]["slots_checked"]}</td>'
        f'<td class="num">{r["warmup_audit"]["violations"]}</td><td>{r["graphs_verified"]}/{r["graphs"]}</td></tr>'
        for r in ranks
    )
    return (
        "<h2>tensor-parallel ranks</h2><table><tr><th>rank</th><th>audit slots</th><th>stray writes</th>"
        f"<th>graphs verified</th></tr>{rows}</table>"
    )


def report_body(report: dict[str, Any], detail: dict[str, Any] | None) -> str:
    notes = "".join(f"<li>{esc(n)}</li>" for n in report["notes"])
    body = (
        header(report)
        + "<h2>start-up timeline</h2>"
        + timeline(report, detail)
        + "<h2>graphs (capture order, largest first)</h2>"
        + graph_table(report)
        + "<h2>warmup KV-write audit</h2>"
        + audit_section(report, detail)
        + "<h2>speculative decoding: acceptance per draft position</h2>"
        + acceptance_chart(report)
        + _ranks(report)
        + (f"<h2>notes</h2><ul>{notes}</ul>" if notes else "")
    )
    if detail is not None:
        view = detail["plan"]
        body += (
            "<h2>warmup steps: block layouts and what each pass wrote</h2>"
            + plan_summary(view, prefix="plan:")
            + legend()
            + '<p class="dim">a dark tick under a position: a pass of this step wrote its slot.</p>'
            + plan_steps(view, report["graphs"], prefix="plan:", overlays=overlays(detail))
        )
    return body


def report_page(report: dict[str, Any], detail: dict[str, Any] | None = None) -> str:
    """The capture report ``report`` (its JSON dict) as a page; ``detail``: a run's extra data."""
    body = f"<h1>warmup run: {esc(report['model'])}</h1>" + report_body(report, detail)
    return document(
        f"warmup run {report['model']}", body, panel_hint="hover or focus a block or a stray write"
    )


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _opt_num(value: float | None, path: str) -> str:
    return "-" if value is None else num(sci(value), path)
