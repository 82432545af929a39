"""``warmup run --html``, ``warmup report FILE --html`` and ``warmup report --diff OLD NEW --html``:
the pages show the JSON report's numbers, and a stray KV write lands on the cell it hit, linked to
its audit sample (the runs: ``conftest.py``)."""

from __future__ import annotations

import json

import pytest
from page_dom import Page, check_numbers, network_references
from typer.testing import CliRunner

from warmcap.audit.kv_writes import AuditResult
from warmcap.cli import app
from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.core.kv_spec import FullAttentionSpec, KVCacheGroup
from warmcap.graphs.proof.report import CaptureReport
from warmcap.pages.report_page import report_page
from warmcap.pages.run_detail import run_detail
from warmcap.warmup.planner import plan_warmup
from warmcap.warmup.run import WarmupResult

runner = CliRunner()


def _cells(plan: dict) -> int:
    return sum(len(ids) for s in plan["steps"] for r in s["requests"] for ids in r["blocks"].values())


@pytest.mark.slow
def test_run_page_shows_the_reports_numbers_timeline_graphs_and_grids(clean_run):
    data, html = clean_run.data, clean_run.html.read_text()
    page = Page(html)
    check_numbers(page, {"": data, "plan": clean_run.plan})
    shown = {e.attrs["data-json"] for e in page.elements if "data-json" in e.attrs}
    for i in range(len(data["graphs"])):
        for key in ("capture_seconds", "memory_bytes", "max_abs_diff"):
            assert f"graphs/{i}/{key}" in shown
    for key, value in data["timings"].items():
        assert (f"timings/{key}" in shown) == (value is not None)
    assert {f"spec_decode/per_position/{i}" for i in range(len(data["spec_decode"]["per_position"]))} <= shown
    assert {"warmup_audit/slots_checked", "warmup_audit/passes", "totals/bytes"} <= shown
    # the warmup steps the run executed, drawn with what each pass wrote
    cells = page.with_class("blk")
    assert len(cells) == _cells(clean_run.plan) > 0
    assert any("written here:" in c.attrs["data-info"] for c in cells)
    assert page.with_class("stray") == [] and page.with_class("violation") == []
    assert network_references(html) == []
    assert len(html.encode()) < 2 * 2**20


@pytest.mark.slow
def test_saved_report_page_and_diff_page_show_their_numbers(clean_run, tmp_path):
    data = clean_run.data
    page_path = tmp_path / "saved.html"
    res = runner.invoke(app, ["report", str(clean_run.report), "--html", str(page_path)])
    assert res.exit_code == 0, res.output
    html = page_path.read_text()
    assert check_numbers(Page(html), {"": data}) > 3 * len(data["graphs"])
    assert "warmup run --html" in html  # says where the block grids are
    assert network_references(html) == []

    # A newer report whose largest graph takes ten times the memory: a regression, shown in red.
    worse = json.loads(json.dumps(data))
    worse["graphs"][0]["memory_bytes"] = data["graphs"][0]["memory_bytes"] * 10 + 2**20
    worse_path = tmp_path / "worse.json"
    worse_path.write_text(json.dumps(worse))
    diff_path = tmp_path / "diff.html"
    args = ["report", "--diff", str(clean_run.report), str(worse_path), "--html", str(diff_path)]
    res = runner.invoke(app, args)
    assert res.exit_code == 1, res.output  # a regression still fails CI, page or not
    html = diff_path.read_text()
    diff = Page(html)
    # totals are derived numbers, recomputed on load: the page shows the report's own
    check_numbers(diff, {"old": data, "new": CaptureReport.from_dict(worse).to_dict()})
    table = next(e for e in diff.elements if e.tag == "table" and "diff" in e.classes)
    red = [
        e
        for e in diff.elements
        if e.tag == "tr" and "regression" in e.classes and e.ancestor("table") is table
    ]
    assert red and all("memory" in r.text for r in red)
    # regressions come first
    rows = [e for e in diff.elements if e.tag == "tr" and e.ancestor("table") is table][1:]
    assert rows[: len(red)] == red
    assert f"{len(red)} regression(s)" in html
    assert network_references(html) == []


@pytest.mark.slow
def test_a_drafter_writing_past_its_blocks_is_marked_on_its_cell_and_linked_to_the_sample(stray_run):
    data = stray_run.data
    samples = data["warmup_audit"]["violation_samples"]
    assert samples
    page = Page(stray_run.html.read_text())
    check_numbers(page, {"": data, "plan": stray_run.plan})
    assert len(page.with_class("blk")) == _cells(stray_run.plan)
    for i, sample in enumerate(samples):
        # the sample in the audit list links to the cell, the cell links back to the sample
        item = page.by_id(f"v{i}")
        assert sample in item.text
        assert any(e.attrs.get("href") == f"#cell-v{i}" and e.ancestor("li") is item for e in page.elements)
        cell = page.by_id(f"cell-v{i}")
        assert cell.attrs["href"] == f"#v{i}"
        assert cell.classes & {"stray", "violation"}
        assert sample in cell.attrs["data-info"]
        # drawn in the step the sample names, in the row of the request it names
        step = cell.ancestor("section")
        assert "bad" in step.classes
        step_name = sample.split("step ", 1)[1].split(" ", 1)[0]
        assert f": {step_name} [" in step.text
        request = sample.split("] ", 1)[1].split(" ", 1)[0]
        assert cell.ancestor("tr").text.startswith(request)
        if "past the" in sample:
            column = int(sample.split("column ", 1)[1].split(" ", 1)[0])
            assert "stray" in cell.classes and f"column {column}" in cell.text
    clean = [e for e in page.elements if e.tag == "section" and "bad" not in e.classes]
    assert clean and not any(
        e.classes & {"stray", "violation"} for e in page.elements if e.ancestor("section") in clean
    )


def test_a_run_without_the_audit_draws_its_steps_and_says_no_writes_were_recorded():
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128),
        speculative=SpeculativeConfig.parse("draft_model:2"),
    )
    groups = [KVCacheGroup("full", FullAttentionSpec(16, num_kv_heads=1, head_size=8), ("l0",))]
    plan = plan_warmup(config, groups, 64)
    result = WarmupResult(plan=plan, audit=AuditResult())  # what run_warmup(audit=False) returns
    report = CaptureReport(model="tiny-llama", device="cpu", backend="eager").to_dict()
    html = report_page(report, run_detail(result))
    page = Page(html)
    check_numbers(page, {"": report, "plan": plan.to_json()})
    assert len(page.with_class("blk")) == _cells(plan.to_json())
    assert "the audit was off" in html and "slots per pass" not in html
    # no graph was captured: every step says it runs eagerly
    assert html.count("no graph fits") == len(plan.steps)
