"""Pages made once per session and shared by the page tests and the browser test: a clean audited
start-up of a tiny model with a drafter, and one whose warmup plan forgot the drafter's lookahead."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

import warmcap.warmup.hook
from warmcap.cli import app
from warmcap.warmup.planner import plan_warmup

RUN = ["run", "--model", "tiny-llama", "--num-blocks", "192", "--max-model-len", "256", "-q"]


@dataclass(frozen=True)
class Run:
    report: Path
    html: Path
    #: the plan the run executed, as ``warmup plan --json`` prints it
    plan: dict

    @property
    def data(self) -> dict:
        return json.loads(self.report.read_text())


@pytest.fixture(scope="session")
def clean_run(tmp_path_factory) -> Run:
    """``warmup run --out --html`` of tiny-llama drafting for itself (exit 0)."""
    out = tmp_path_factory.mktemp("clean-run")
    report, html = out / "report.json", out / "report.html"
    args = [
        *RUN,
        "--spec",
        "draft_model:2",
        "--capture-sizes",
        "1,2,4",
        "--out",
        str(report),
        "--html",
        str(html),
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    plan_args = ["plan", "--model", "tiny-llama", "--spec", "draft_model:2", "--num-blocks", "192"]
    plan_args += [
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "256",
        "--json",
    ]
    return Run(report, html, json.loads(CliRunner().invoke(app, plan_args).output))


@pytest.fixture(scope="session")
def stray_run(tmp_path_factory) -> Run:
    """The same start-up (dflash:7) with a warmup plan built without the drafter's lookahead: the
    drafter writes past its blocks, the audit catches it and ``warmup run`` exits 1."""
    out = tmp_path_factory.mktemp("stray-run")
    report, html = out / "report.json", out / "report.html"
    plans = []

    def broken(*args, **kwargs):
        plans.append(plan_warmup(*args, lookahead_override=0, **kwargs))
        return plans[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(warmcap.warmup.hook, "plan_warmup", broken)
        args = [
            *RUN,
            "--spec",
            "dflash:7",
            "--capture-sizes",
            "1,2",
            "--out",
            str(report),
            "--html",
            str(html),
        ]
        res = CliRunner().invoke(app, args)
    assert res.exit_code == 1, res.output
    (plan,) = plans
    return Run(report, html, plan.to_json())
