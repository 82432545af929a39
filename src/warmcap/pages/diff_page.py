"""``warmup report --diff OLD NEW --html``: two capture reports side by side, regressions first."""

from __future__ import annotations

from typing import Any

from warmcap.pages.html import document, esc
from warmcap.pages.report_page import acceptance_chart, graph_table, header, timeline

_ORDER = {"regression": 0, "improvement": 1, "same": 2}


def _side(report: dict[str, Any], root: str) -> str:
    """One report's column; its shown numbers point into ``root`` (``old:`` or ``new:``)."""
    html = (
        header(report)
        + "<h3>start-up timeline</h3>"
        + timeline(report, None)
        + "<h3>graphs</h3>"
        + graph_table(report)
        + "<h3>acceptance per position</h3>"
        + acceptance_chart(report)
    )
    return html.replace('data-json="', f'data-json="{root}')


def diff_page(
    old: dict[str, Any], new: dict[str, Any], rows: list[dict[str, str]], *, names: tuple[str, str]
) -> str:
    """``rows``: the compared metrics (``metric``, ``old``, ``new``, ``status``) of
    ``graphs.proof.diff.diff_reports``; ``names``: the two files, as the user gave them."""
    regressions = [r for r in rows if r["status"] == "regression"]
    verdict = (
        f'<span class="badge fail">{len(regressions)} regression(s)</span>'
        if regressions
        else '<span class="badge ok">no regressions</span>'
    )
    table = "".join(
        f'<tr class="{esc(r["status"])}"><td>{esc(r["metric"])}</td><td class="num">{esc(r["old"])}</td>'
        f'<td class="num">{esc(r["new"])}</td><td class="status">{esc(r["status"])}</td></tr>'
        for r in sorted(rows, key=lambda r: _ORDER[r["status"]])
    )
    body = (
        f"<h1>capture report diff: {esc(new['model'])}</h1>"
        f'<p class="meta"><b>old</b> {esc(names[0])} · <b>new</b> {esc(names[1])}</p><p>{verdict}</p>'
        f'<table class="diff"><tr><th>metric</th><th>old</th><th>new</th><th>status</th></tr>{table}</table>'
        f'<div class="cols"><div><h2>old: {esc(names[0])}</h2>{_side(old, "old:")}</div>'
        f"<div><h2>new: {esc(names[1])}</h2>{_side(new, 'new:')}</div></div>"
    )
    return document(
        f"capture report diff {new['model']}", body, panel_hint="regressions are red, improvements green"
    )
