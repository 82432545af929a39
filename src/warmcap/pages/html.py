"""The pieces every page shares: escaping, number formats, one stylesheet, one small script.

Every number a page shows that also appears in the JSON output carries ``data-json="graphs/0/memory_bytes"``,
its path in that JSON (``/``-separated; ``plan:``, ``old:`` or ``new:`` first when it is not the
page's main JSON), so a test (or a curious reader) can check the page against the data.
"""

from __future__ import annotations

from html import escape

#: colours of a position's state in a block (also the legend)
STATE_COLOURS = {
    "computed": "#8da0cb",
    "scheduled": "#2b8a3e",
    "draft": "#f08c00",
    "lookahead": "#f5d76e",
    "free": "#f1f3f5",
}
STATE_EXPLAINED = {
    "computed": "computed: KV already written by earlier steps",
    "scheduled": "scheduled: this step's tokens (prompt, or the sampled token)",
    "draft": "draft: this step's draft tokens being verified",
    "lookahead": "lookahead: where the drafter writes next (reserved, not scheduled)",
    "free": "reserved, unused",
}

CSS = """
body{font:13px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#212529;background:#fff}
main{padding:12px 20px;margin-right:260px}
h1{font-size:20px;margin:4px 0 8px}h2{font-size:16px;margin:18px 0 6px;border-bottom:1px solid #dee2e6}
h3{font-size:14px;margin:4px 0}
.meta{color:#495057}.meta b{color:#212529}
table{border-collapse:collapse;margin:4px 0}td,th{padding:2px 8px;text-align:left;vertical-align:middle;white-space:nowrap}
th{background:#f1f3f5;font-weight:600}tr+tr td{border-top:1px solid #f1f3f5}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.step{border:1px solid #ced4da;border-radius:6px;margin:10px 0;padding:6px 10px;overflow-x:auto}
.step.bad{border:2px solid #c92a2a;background:#fff5f5}
.shape{color:#495057;margin:2px 0 4px}.shape b{color:#212529}
.row{display:flex;gap:3px;align-items:center;flex-wrap:nowrap}
.blk{display:inline-flex;flex-direction:column;border:1px solid #868e96;border-radius:3px;
 padding:1px;cursor:pointer;background:#fff;text-decoration:none;color:inherit}
.blk svg{display:block}.blk .id{font-size:10px;text-align:center;line-height:12px}
.blk.null{border-style:dashed;background:repeating-linear-gradient(45deg,#fff,#fff 4px,#e9ecef 4px,#e9ecef 8px)}
.blk.shared{border:2px solid #7048e8}.blk.hl{outline:3px solid #7048e8}
.blk.violation,.stray{outline:3px solid #e03131;background:#ffe3e3}
.stray{display:inline-flex;flex-direction:column;border:2px dashed #e03131;border-radius:3px;padding:1px;
 font-size:10px;color:#c92a2a;text-decoration:none;text-align:center}
.crossed{font-size:11px;color:#5f3dc4}
.legend span.sw{display:inline-block;width:12px;height:12px;vertical-align:-2px;margin:0 3px 0 10px;
 border:1px solid #868e96}
.ok{color:#2b8a3e;font-weight:600}.fail{color:#c92a2a;font-weight:700}.dim{color:#868e96}
.badge{display:inline-block;border-radius:10px;padding:0 8px;margin-right:6px;font-weight:600}
.badge.ok{background:#d3f9d8}.badge.fail{background:#ffe3e3}
.bar{display:inline-block;height:10px;background:#4c6ef5;vertical-align:middle;margin-right:4px}
.bar.mem{background:#12b886}
tr.regression td{background:#ffe3e3}tr.improvement td{background:#ebfbee}tr.regression td.status{color:#c92a2a;font-weight:700}
.samples li{margin:2px 0;font-family:ui-monospace,monospace;font-size:12px}
.samples li:target{background:#fff3bf}
#panel{position:fixed;top:0;right:0;width:250px;height:100%;overflow:auto;border-left:1px solid #dee2e6;
 background:#f8f9fa;padding:10px;box-sizing:border-box;font-size:12px}
#panel pre{white-space:pre-wrap;font:12px/1.4 ui-monospace,monospace;margin:0}
.cols{display:flex;gap:16px}.cols>div{flex:1;min-width:0}
svg text{font:11px system-ui,sans-serif}
"""

# Hover or click a block: the side panel shows its numbers, and every cell of the same block id in
# the same group (the request across steps, or a shared prefix) is outlined.
SCRIPT = """
(function(){
var panel=document.getElementById('panel-body');
function show(el){
 if(!panel)return;
 panel.textContent=el.getAttribute('data-info')||'';
 document.querySelectorAll('.hl').forEach(function(x){x.classList.remove('hl');});
 var g=el.getAttribute('data-group'),b=el.getAttribute('data-block');
 if(g!==null&&b!==null&&b!=='0'){
  document.querySelectorAll('.blk[data-group="'+g+'"][data-block="'+b+'"]').forEach(function(x){x.classList.add('hl');});
 }
}
document.querySelectorAll('[data-info]').forEach(function(el){
 el.addEventListener('mouseenter',function(){show(el);});
 el.addEventListener('focus',function(){show(el);});
});
var first=document.querySelector('[data-focus="1"]')||document.querySelector('[data-focus="2"]');
if(first)show(first);
document.body.setAttribute('data-rendered','1');
})();
"""


def esc(text: object) -> str:
    """``text`` made safe for HTML text and attribute values."""
    return escape(str(text), quote=True)


def seconds(value: float | None) -> str:
    """Seconds, or milliseconds under a tenth of a second (a static-backend capture takes ~0.1 ms)."""
    if value is None:
        return "-"
    return f"{value * 1e3:.2f} ms" if value < 0.1 else f"{value:.3f} s"


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def yes_no(value: bool | None) -> str:
    if value is None:
        return '<span class="dim">-</span>'
    return '<span class="ok">yes</span>' if value else '<span class="fail">NO</span>'


def num(text: str, path: str, *, cls: str = "") -> str:
    """A shown number tied to its JSON path (``data-json``)."""
    extra = f' class="{cls}"' if cls else ""
    return f'<span data-json="{esc(path)}"{extra}>{esc(text)}</span>'


def legend() -> str:
    items = "".join(
        f'<span class="sw" style="background:{STATE_COLOURS[k]}"></span>{esc(v)}'
        for k, v in STATE_EXPLAINED.items()
    )
    return (
        f'<div class="legend">{items}<span class="sw" style="background:repeating-linear-gradient(45deg,'
        '#fff,#fff 3px,#adb5bd 3px,#adb5bd 6px)"></span>null block 0 (nothing may be written there)'
        '<span class="sw" style="border:2px solid #7048e8"></span>block shared by several requests'
        '<span class="sw" style="border:2px dashed #e03131;background:#ffe3e3"></span>stray KV write</div>'
    )


def document(title: str, body: str, *, panel_hint: str) -> str:
    """A whole page: ``body`` plus the shared style, the side panel and the script."""
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{CSS}</style></head><body><main>{body}</main>"
        f'<aside id="panel"><h3>details</h3><pre id="panel-body">{esc(panel_hint)}</pre></aside>'
        f"<script>{SCRIPT}</script></body></html>\n"
    )
