"""``warmup plan --html`` lists exactly the graphs ``warmup run`` with the same flags captures: the
page draws the capture planner's own plan, so Mamba layers, sparse MLA and ``--capture-sizes`` shape
it as they shape the run."""

from __future__ import annotations

import json
from functools import partial

import pytest
from page_dom import Page
from typer.testing import CliRunner

import warmcap.graphs.hook
from warmcap.cli import app
from warmcap.graphs.proof.report import GraphRecord
from warmcap.graphs.startup import capture_graphs

runner = CliRunner()
SMALL = [
    "--num-blocks",
    "64",
    "--max-model-len",
    "128",
    "--max-num-seqs",
    "2",
    "--max-num-batched-tokens",
    "16",
]

CASES = {
    # tiny-llama drafting for itself on the default ladder: target and drafter graphs
    "plain": ["--model", "tiny-llama", *SMALL],
    # sizes of the user's, one above the runner's 16-token buffers (dropped by the run)
    "capture-sizes": ["--model", "tiny-llama", "--spec", "none", *SMALL, "--capture-sizes", "1,3,40"],
    # DeepSeek-V3.2's sparse MLA: the mixed graphs are sparse_mla ones
    "sparse-mla": ["--model", "tiny-deepseek-v32", "--spec", "none", *SMALL],
    # Mamba-hybrid as a CUDA run plans it: no ragged (mixed, draft-prefill) graphs, and one-query
    # decode graphs for the n-gram drafter that may draft nothing
    "mamba-ngram-cuda": ["--model", "tiny-hybrid", "--spec", "ngram:2", *SMALL, "--backend", "cuda"],
    "mamba-draft-model-cuda": ["--model", "tiny-hybrid", *SMALL, "--backend", "cuda"],
    # no graph at all
    "enforce-eager": ["--model", "tiny-llama", "--spec", "none", *SMALL, "--enforce-eager"],
}


def _planned(args: list[str], tmp_path) -> tuple[list[str], Page]:
    out = tmp_path / "plan.html"
    res = runner.invoke(app, ["plan", *args, "--html", str(out)])
    assert res.exit_code == 0, res.output
    page = Page(out.read_text())
    return [e.attrs["data-label"] for e in page.with_class("graph")], page


def _captured(args: list[str], tmp_path, monkeypatch) -> list[str]:
    """The graph labels of the report ``warmup run`` writes. A ``--backend cuda`` case runs on this
    machine's ``static`` backend over the plan the ``cuda`` backend makes (``plan_backend``), which
    is what a GPU run captures."""
    if "--backend" in args:
        i = args.index("--backend")
        monkeypatch.setattr(
            warmcap.graphs.hook, "capture_graphs", partial(capture_graphs, plan_backend=args[i + 1])
        )
        args = [*args[:i], *args[i + 2 :]]
    report = tmp_path / "report.json"
    res = runner.invoke(app, ["run", *args, "--no-startup-cache", "-q", "--out", str(report)])
    assert res.exit_code == 0, res.output
    return [GraphRecord(**g).label for g in json.loads(report.read_text())["graphs"]]


@pytest.mark.parametrize("case", list(CASES))
def test_plan_page_lists_exactly_the_graphs_the_run_captures(case, tmp_path, monkeypatch):
    args = CASES[case]
    listed, page = _planned(args, tmp_path)
    captured = _captured(args, tmp_path, monkeypatch)
    assert len(set(listed)) == len(listed)
    assert sorted(listed) == sorted(captured)
    assert page.by_id("graph-count").text == str(len(captured))
    # each step is looked up among those graphs: a step's graph is one the run has
    warmed = [e.text for e in page.with_class("warms")]
    assert set(warmed) <= set(captured)
    assert bool(warmed) == bool(captured) == (case != "enforce-eager")


def test_plan_refuses_an_unknown_graph_backend_in_one_line():
    res = runner.invoke(app, ["plan", "--model", "tiny-llama", "--backend", "cudda"])
    assert res.exit_code == 2
    assert "unknown graph backend 'cudda'" in res.output and "cuda, static, compile" in res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
