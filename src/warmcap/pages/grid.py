"""One warmup step drawn as block grids: per request, per KV group, a row of block cells.

A cell is one block-table entry; inside it, one mark per token position coloured by its state at
this step (computed, scheduled, draft, lookahead, free). The null block 0 is hatched, a block two
requests hold is framed, and a stray KV write the audit found is drawn on the cell it hit (or, past
the request's blocks, on a dashed cell after them) and linked to its audit sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from warmcap.pages.html import STATE_COLOURS, esc, num

#: a group whose blocks hold no token positions (encoder KV): drawn without position marks
_UNPOSITIONED = ("cross_attention",)
#: widest a block's position strip is drawn, in pixels
_MAX_STRIP = 96
#: ``data-focus`` values: what the side panel shows when the page opens (the first of the lowest)
FOCUS_STRAY, FOCUS_LOOKAHEAD = "1", "2"


@dataclass(slots=True)
class StepOverlay:
    """What a run adds to a planned step: each pass's writes and the audit's violations.

    ``writes[(req_id, group)]`` lists ``(phase, position, slot)``; ``violations`` are the audit's
    violation dicts (``index`` is the sample's number on the page).
    """

    writes: dict[tuple[str, str], list[tuple[str, int, int]]] = field(default_factory=dict)
    violations: list[dict[str, Any]] = field(default_factory=list)


def states(req: dict[str, Any], lookahead: int) -> list[tuple[str, int, int]]:
    """The position ranges ``[lo, hi)`` of a planned request at its step, by state."""
    c, s, d = req["num_computed_tokens"], req["num_scheduled_tokens"], req["num_spec_tokens"]
    return [
        ("computed", 0, c),
        ("scheduled", c, c + s - d),
        ("draft", c + s - d, c + s),
        ("lookahead", c + s, c + s + lookahead),
    ]


def _state_at(ranges: list[tuple[str, int, int]], pos: int) -> str:
    for name, lo, hi in ranges:
        if lo <= pos < hi:
            return name
    return "free"


def _strip(block_size: int, col: int, ranges: list[tuple[str, int, int]], written: set[int]) -> str:
    """The SVG strip of one block: a mark per position (or per span when the block is wide)."""
    per = max(1, _MAX_STRIP // block_size) if block_size <= _MAX_STRIP // 2 else 0
    width = per * block_size if per else _MAX_STRIP
    first = col * block_size
    rects: list[str] = []
    if per:
        for i in range(block_size):
            state = _state_at(ranges, first + i)
            rects.append(
                f'<rect x="{i * per}" y="0" width="{max(1, per - 1)}" height="12" '
                f'fill="{STATE_COLOURS[state]}"/>'
            )
            if first + i in written:
                rects.append(
                    f'<rect x="{i * per}" y="13" width="{max(1, per - 1)}" height="3" fill="#212529"/>'
                )
    else:
        scale = width / block_size
        rects.append(f'<rect x="0" y="0" width="{width}" height="12" fill="{STATE_COLOURS["free"]}"/>')
        for name, lo, hi in ranges:
            lo, hi = max(lo, first), min(hi, first + block_size)
            if hi > lo:
                x = (lo - first) * scale
                rects.append(
                    f'<rect x="{x:.1f}" y="0" width="{(hi - lo) * scale:.1f}" height="12" '
                    f'fill="{STATE_COLOURS[name]}"/>'
                )
        for p in sorted(w for w in written if first <= w < first + block_size):
            rects.append(f'<rect x="{(p - first) * scale:.1f}" y="13" width="2" height="3" fill="#212529"/>')
    return f'<svg width="{width}" height="16" aria-hidden="true">{"".join(rects)}</svg>'


def _spans(values: list[int]) -> str:
    """``3-5, 9``: sorted integers as ranges."""
    out: list[str] = []
    vals = sorted(set(values))
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        out.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ", ".join(out)


def _writes_text(writes: list[tuple[str, int, int]], lo: int, hi: int) -> str:
    by_phase: dict[str, list[tuple[int, int]]] = {}
    for phase, pos, slot in writes:
        if lo <= pos < hi:
            by_phase.setdefault(phase, []).append((pos, slot))
    lines = [
        f"  {phase}: positions {_spans([p for p, _ in ws])} -> slots {_spans([s for _, s in ws])}"
        for phase, ws in by_phase.items()
    ]
    return ("\nwritten here:\n" + "\n".join(lines)) if lines else ""


def _crossing_text(how: str | None) -> str:
    if how == "lookahead":
        return "\nnew this step for the drafter's lookahead alone: no scheduled token lands here yet"
    if how == "tokens":
        return "\nnew this step: the scheduled tokens entered it"
    return ""


def step_grid(
    index: int,
    step: dict[str, Any],
    groups: list[dict[str, Any]],
    lookahead: int,
    *,
    path: str,
    overlay: StepOverlay | None = None,
) -> str:
    """The table of one step: a row per request with its numbers and one block row per group.
    ``path`` is the JSON path prefix of ``step`` (e.g. ``steps.3``) for the shown numbers."""
    overlay = overlay or StepOverlay()
    holders: dict[tuple[str, int], list[str]] = {}
    for r in step["requests"]:
        for g, ids in r["blocks"].items():
            for b in ids:
                if b != 0:
                    holders.setdefault((g, b), []).append(r["req_id"])
    head = "".join(
        f"<th>blocks: {esc(g['name'])} ({esc(g['kind'])}, bs={g['block_size']})</th>" for g in groups
    )
    rows = []
    for j, r in enumerate(step["requests"]):
        p = f"{path}/requests/{j}"
        cells = [
            f"<td>{esc(r['req_id'])}</td>",
            *(
                f'<td class="num">{num(str(r[k]), f"{p}/{k}")}</td>'
                for k in ("num_computed_tokens", "num_scheduled_tokens", "num_spec_tokens")
            ),
            f'<td class="num">{r.get("num_lookahead_tokens", lookahead)}</td>',
        ]
        for g in groups:
            cells.append(
                f'<td><div class="row">{_block_row(index, step, r, g, lookahead, p, holders, overlay)}</div></td>'
            )
        crossed = ", ".join(f"{g} ({how})" for g, how in r.get("crossed", {}).items())
        cells.append(f'<td class="crossed">{esc(crossed) or "-"}</td>')
        rows.append(f"<tr>{''.join(cells)}</tr>")
    for g in groups:
        # A padded token that wrote a real slot belongs to no request: one row shows it.
        pad = [v for v in overlay.violations if v["request"] == "<padding>" and v["group"] == g["name"]]
        if pad:
            links = "".join(_stray(v, "padding") for v in pad)
            rows.append(
                f'<tr><td colspan="{5 + len(groups) + 1}">&lt;padding&gt; in {esc(g["name"])}: {links}</td></tr>'
            )
    return (
        '<table class="grid"><tr><th>request</th><th>computed</th><th>scheduled</th><th>drafts</th>'
        f"<th>lookahead</th>{head}<th>boundary crossed</th></tr>{''.join(rows)}</table>"
    )


def _block_row(
    index: int,
    step: dict[str, Any],
    req: dict[str, Any],
    group: dict[str, Any],
    lookahead: int,
    path: str,
    holders: dict[tuple[str, int], list[str]],
    overlay: StepOverlay,
) -> str:
    name, bs = group["name"], group["block_size"]
    ids = req["blocks"].get(name, [])
    positioned = group["kind"] not in _UNPOSITIONED
    ranges = states(req, req.get("num_lookahead_tokens", lookahead)) if positioned else []
    writes = overlay.writes.get((req["req_id"], name), [])
    written = {pos for _, pos, _ in writes}
    mine = [v for v in overlay.violations if v["request"] == req["req_id"] and v["group"] == name]
    out = []
    for col, block in enumerate(ids):
        lo, hi = col * bs, (col + 1) * bs
        hits = [v for v in mine if v["position"] >= 0 and v["position"] // bs == col]
        cls = ["blk"]
        if block == 0:
            cls.append("null")
        others = [h for h in holders.get((name, block), []) if h != req["req_id"]]
        if others:
            cls.append("shared")
        if hits:
            cls.append("violation")
        info = (
            f"step {index}: {step['name']}\nrequest {req['req_id']}\ngroup {name}, column {col}: "
            + ("null block 0 (placeholder: nothing may be written)" if block == 0 else f"block {block}")
            + (f"\npositions {lo}-{hi - 1}" if positioned else "\n(encoder KV: no token positions)")
            + (f"\nshared with {', '.join(others)}" if others else "")
            + (
                f"\ncomputed {req['num_computed_tokens']}, scheduled {req['num_scheduled_tokens']} "
                f"(drafts {req['num_spec_tokens']}), lookahead {req.get('num_lookahead_tokens', lookahead)}"
            )
            + _crossing_text(req.get("crossed", {}).get(name) if col == len(ids) - 1 else None)
            + _writes_text(writes, lo, hi)
            + "".join(f"\nSTRAY WRITE #{v['index']}: {v['text']}" for v in hits)
        )
        label = "null" if block == 0 else str(block)
        shown = (
            num(label, f"{path}/blocks/{name}/{col}", cls="id")
            if block != 0
            else '<span class="id">null</span>'
        )
        strip = _strip(bs, col, ranges, written) if positioned else ""
        # The panel opens on the first stray write, else on the first block only the lookahead took.
        focus = FOCUS_STRAY if hits else ""
        if not focus and col == len(ids) - 1 and req.get("crossed", {}).get(name) == "lookahead":
            focus = FOCUS_LOOKAHEAD
        attrs = (
            f'class="{" ".join(cls)}" data-group="{esc(name)}" data-block="{block}" '
            f'data-step="{index}" data-info="{esc(info)}" tabindex="0"'
            + (f' data-focus="{focus}"' if focus else "")
        )
        if hits:
            v = hits[0]
            out.append(f'<a {attrs} id="cell-v{v["index"]}" href="#v{v["index"]}">{strip}{shown}</a>')
        else:
            out.append(f"<div {attrs}>{strip}{shown}</div>")
    for v in mine:
        if v["position"] < 0 or v["position"] // bs >= len(ids):
            out.append(_stray(v, f"column {v['position'] // bs}" if v["position"] >= 0 else "no blocks"))
    return "".join(out)


def _stray(v: dict[str, Any], where: str) -> str:
    """A write outside every block the request holds: a dashed cell after its row."""
    info = f"STRAY WRITE #{v['index']}\n{v['text']}"
    return (
        f'<a class="stray" id="cell-v{v["index"]}" href="#v{v["index"]}" data-info="{esc(info)}" '
        f'data-focus="{FOCUS_STRAY}" tabindex="0">{esc(where)}<br>block {v["block"]}<br>#{v["index"]}</a>'
    )
