"""Each page in a real browser (headless Chromium, from disk, offline): it renders without a
console message, its DOM holds the block grid the plan says, and a stray write is on screen."""

from __future__ import annotations

import json

import pytest
from browser import load
from page_dom import Page
from typer.testing import CliRunner

from warmcap.cli import app

PNG = b"\x89PNG\r\n\x1a\n"


def _cells(plan: dict) -> int:
    return sum(len(ids) for s in plan["steps"] for r in s["requests"] for ids in r["blocks"].values())


def _rendered(loaded) -> Page:
    assert loaded.console == [], loaded.console
    dom = Page(loaded.dom)
    body = next(e for e in dom.elements if e.tag == "body")
    assert body.attrs.get("data-rendered") == "1"  # the page's script ran to its end
    shot = loaded.screenshot.read_bytes()
    assert shot.startswith(PNG) and len(shot) > 10_000
    return dom


def test_plan_page_renders_its_block_grid(tmp_path):
    html = tmp_path / "plan.html"
    args = ["plan", "--model", "tiny-llama", "--spec", "eagle3:3", "--num-blocks", "64"]
    res = CliRunner().invoke(app, [*args, "--html", str(html)])
    assert res.exit_code == 0, res.output
    plan = json.loads(CliRunner().invoke(app, [*args, "--json"]).output)
    dom = _rendered(load(html, tmp_path / "plan.png"))
    assert len(dom.with_class("blk")) == _cells(plan) > 0


@pytest.mark.slow
def test_run_saved_report_and_diff_pages_render(clean_run, tmp_path):
    dom = _rendered(load(clean_run.html, tmp_path / "run.png"))
    assert len(dom.with_class("blk")) == _cells(clean_run.plan)
    assert dom.with_class("stray") == []

    saved = tmp_path / "saved.html"
    assert CliRunner().invoke(app, ["report", str(clean_run.report), "--html", str(saved)]).exit_code == 0
    dom = _rendered(load(saved, tmp_path / "saved.png"))
    assert len([e for e in dom.elements if e.tag == "tr"]) > len(clean_run.data["graphs"])

    diff = tmp_path / "diff.html"
    res = CliRunner().invoke(
        app, ["report", "--diff", str(clean_run.report), str(clean_run.report), "--html", str(diff)]
    )
    assert res.exit_code == 0, res.output
    _rendered(load(diff, tmp_path / "diff.png"))


@pytest.mark.slow
def test_a_stray_write_is_on_screen_in_its_step_and_linked(stray_run, tmp_path):
    dom = _rendered(load(stray_run.html, tmp_path / "stray.png", height=3400))
    assert len(dom.with_class("blk")) == _cells(stray_run.plan)
    strays = dom.with_class("stray") + dom.with_class("violation")
    samples = stray_run.data["warmup_audit"]["violation_samples"]
    assert samples and len(strays) >= len(samples)
    linked = {e.attrs.get("href") for e in strays}
    assert {f"#v{i}" for i in range(len(samples))} <= linked
