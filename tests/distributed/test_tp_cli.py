"""``--tensor-parallel-size`` on the CLI: ``warmup run`` reports every rank; ``warmup plan`` is
the same plan whatever the rank count (rank 0 makes it once, every rank runs it)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from warmcap.cli import app
from warmcap.graphs.proof.report import CaptureReport, RankRow, WarmupAudit, schema_problem

runner = CliRunner()


@pytest.mark.slow
def test_warmup_run_tp2_reports_both_ranks_clean_and_verified(tmp_path):
    out = tmp_path / "report.json"
    args = ["run", "-m", "tiny-llama", "--max-num-seqs", "2", "--capture-sizes", "1,2,4", "--out", str(out)]
    res = runner.invoke(app, [*args, "--tensor-parallel-size", "2", "--strict"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert schema_problem(data) == ""
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for row in data["ranks"]:
        assert row["warmup_audit"]["violations"] == 0
        assert row["warmup_audit"]["slots_checked"] > 0
        assert row["graphs"] == len(data["graphs"]) > 0
        assert row["all_verified"]
    assert data["totals"]["all_verified"]
    # Every rank ran the same plan: the same steps, passes and slots.
    assert data["ranks"][0]["warmup_audit"] == data["ranks"][1]["warmup_audit"] == data["warmup_audit"]
    assert "tensor-parallel ranks: all ranks clean" in res.output


@pytest.mark.parametrize("spec", ["none", "eagle:2"])
def test_warmup_plan_is_unchanged_by_tp(spec):
    base = ["plan", "-m", "smollm2-135m", "--spec", spec, "--json"]
    one = runner.invoke(app, base)
    two = runner.invoke(app, [*base, "--tensor-parallel-size", "2"])
    assert one.exit_code == 0 and two.exit_code == 0, one.output + two.output
    assert two.output == one.output


def test_warmup_plan_refuses_tp_for_a_family_start_up_refuses():
    res = runner.invoke(app, ["plan", "-m", "tiny-deepseek-v3", "-tp", "2", "--json"])
    assert res.exit_code != 0
    assert "does not support tensor parallelism yet" in res.output
    assert "Traceback" not in res.output


def test_bad_tensor_parallel_size_is_a_usage_error():
    res = runner.invoke(app, ["plan", "-m", "tiny-llama", "--tensor-parallel-size", "0"])
    assert res.exit_code != 0
    assert "tensor_parallel_size must be an integer >= 1, got 0" in res.output
    assert "Traceback" not in res.output


def test_rank_rows_round_trip_and_decide_the_verdict():
    clean = RankRow(0, WarmupAudit(steps=2, passes=4, slots_checked=9), graphs=3, graphs_verified=3)
    failed = RankRow(1, WarmupAudit(steps=2, passes=4, slots_checked=9), graphs=3, graphs_verified=2)
    report = CaptureReport(model="m", device="cpu", backend="static", ranks=[clean, failed])
    data = report.to_dict()
    assert schema_problem(data) == ""
    assert not data["totals"]["all_verified"]
    assert CaptureReport.from_dict(data) == report
    one_device = CaptureReport(model="m", device="cpu", backend="static").to_dict()
    assert "ranks" not in one_device
    assert schema_problem(one_device) == ""
