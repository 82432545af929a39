from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest
from rich.console import Console

from warmcap.errors import ConfigError
from warmcap.graphs.proof.diff import diff_reports
from warmcap.graphs.proof.render import render, render_diff
from warmcap.graphs.proof.report import (
    CaptureReport,
    GraphRecord,
    SpecDecodeStats,
    SpecInfo,
    WarmupAudit,
    report_schema,
)


def _report(backend: str = "static") -> CaptureReport:
    graphs = [
        GraphRecord("decode", "FULL", 8, 4, 2, 0.20, 4 << 20, True, 0.0, 1e-7, True, cuda_safe=True),
        GraphRecord("decode", "FULL", 4, 2, 2, 0.10, 2 << 20, True, 0.0, 0.0, True),
        GraphRecord("mixed", "PIECEWISE", 16, None, None, 0.30, 8 << 20, True, 0.0, 2e-7, True),
        GraphRecord("draft_decode", "FULL", 4, 4, 1, 0.05, 1 << 20, True, 0.0, 0.0, True),
    ]
    return CaptureReport(
        model="tiny-llama",
        device="cpu",
        backend=backend,
        spec=SpecInfo("eagle", 1),
        capture_sizes=[1, 2, 4, 8, 16],
        graphs=graphs,
        warmup_audit=WarmupAudit(steps=9, passes=9, slots_checked=412, violations=0),
        spec_decode=SpecDecodeStats(
            num_drafts=40, num_draft_tokens=40, num_accepted_tokens=30, per_position=[30]
        ),
        timings={"load": 0.5, "warmup": 1.25, "capture": 0.65},
        notes=["draft graphs captured with the eagle seam"],
    )


def test_json_validates_against_schema_and_round_trips() -> None:
    report = _report()
    data = json.loads(report.to_json())
    jsonschema.Draft202012Validator.check_schema(report_schema())
    jsonschema.validate(data, report_schema(), cls=jsonschema.Draft202012Validator)
    assert data["totals"] == {
        "count": 4,
        "seconds": pytest.approx(0.65),
        "bytes": 15 << 20,
        "all_verified": True,
        "cuda_unsafe": 0,
    }
    assert data["graphs"][0]["cuda_safe"] is True and data["graphs"][1]["cuda_safe"] is None
    assert data["spec_decode"]["acceptance_length"] == pytest.approx(1.75)
    assert data["timings"]["smoke"] is None
    assert CaptureReport.from_json(report.to_json()) == report


def test_schema_rejects_a_broken_report() -> None:
    data = json.loads(_report().to_json())
    data["graphs"][0]["phase"] = "prefill"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, report_schema(), cls=jsonschema.Draft202012Validator)


def test_non_finite_diffs_do_not_break_json() -> None:
    bad = GraphRecord("decode", "FULL", 2, 1, 2, 0.1, 0, False, float("nan"), float("inf"), False)
    report = replace(_report(), graphs=[bad])
    data = json.loads(report.to_json())
    jsonschema.validate(data, report_schema(), cls=jsonschema.Draft202012Validator)
    assert data["graphs"][0]["max_abs_diff"] is None and data["totals"]["all_verified"] is False


def test_from_json_errors_are_actionable() -> None:
    with pytest.raises(ConfigError, match="version"):
        CaptureReport.from_json('{"version": 99}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        CaptureReport.from_json("{")


def test_identical_reports_have_no_regressions() -> None:
    result = diff_reports(_report(), _report())
    assert not result.has_regressions and result.regressions == [] and result.improvements == []


def _with_graph(report: CaptureReport, index: int, **changes) -> CaptureReport:
    graphs = list(report.graphs)
    graphs[index] = replace(graphs[index], **changes)
    return replace(report, graphs=graphs)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda r: _with_graph(r, 2, capture_seconds=0.9), "capture time"),
        (lambda r: _with_graph(r, 0, memory_bytes=6 << 20), "memory"),
        (
            lambda r: replace(r, spec_decode=replace(r.spec_decode, num_accepted_tokens=20)),
            "acceptance length",
        ),
        (lambda r: replace(r, warmup_audit=replace(r.warmup_audit, violations=2)), "violations"),
        (lambda r: _with_graph(r, 1, verified=False), "stopped verifying"),
        (
            lambda r: _with_graph(r, 0, cuda_safe=False, cuda_unsafe_reason="aten.nonzero at x.py:1"),
            "would no longer record under CUDA: aten.nonzero",
        ),
        (lambda r: replace(r, graphs=r.graphs[1:]), "disappeared"),
    ],
)
def test_diff_detects_injected_regression(mutate, expected: str) -> None:
    old = _report()
    result = diff_reports(old, mutate(old))
    assert result.has_regressions
    assert any(expected in line for line in result.regressions), result.regressions
    # The reverse direction is an improvement. (A graph that appears legitimately raises total
    # capture time and memory, so that case is checked separately.)
    back = diff_reports(mutate(old), old)
    assert back.improvements
    if expected != "disappeared":
        assert not back.has_regressions
    else:
        assert all("total" in line for line in back.regressions)


def test_small_changes_within_tolerance_are_not_regressions() -> None:
    old = _report()
    new = _with_graph(old, 2, capture_seconds=0.33, memory_bytes=int((8 << 20) * 1.05))
    assert not diff_reports(old, new).has_regressions


def _text(fn, *args) -> str:
    console = Console(record=True, width=160, color_system=None)
    fn(*args, console)
    return console.export_text()


def test_render_static_says_no_graph_was_recorded() -> None:
    text = _text(render, _report("static"))
    assert "No CUDA graph was recorded on this machine" in text
    assert "tiny-llama" in text and "decode" in text and "draft_decode" in text
    assert "4 graphs" in text and "all verified" in text
    assert "acceptance length 1.75" in text and "no stray KV write" in text
    cuda_text = _text(render, _report("cuda"))
    assert "No CUDA graph was recorded" not in cuda_text and "torch.cuda.CUDAGraph" in cuda_text


def test_render_names_graphs_that_would_not_record_under_cuda_and_why() -> None:
    report = _with_graph(
        _report("static"), 0, cuda_safe=False, cuda_unsafe_reason="aten.nonzero at moe.py:71"
    )
    report = replace(report, batch_invariant=True)
    text = _text(render, report)
    assert "batch-invariant" in text
    assert "1 graph(s) checked" in text and "1 would not record" in text
    assert "decode FULL t=8 r=4 q=2: aten.nonzero at moe.py:71" in text
    assert report.totals.cuda_unsafe == 1
    assert CaptureReport.from_json(report.to_json()) == report
    safe = _text(render, _report("static"))
    assert "all would record" in safe
    # Without batch invariance, nonzero real-row differences get explained (and the flag named).
    assert "float rounding" in safe and "--batch-invariant makes them match" in safe
    assert "float rounding" not in text


def test_render_diff_lists_regressions_first() -> None:
    old = _report()
    text = _text(render_diff, diff_reports(old, _with_graph(old, 1, verified=False)))
    assert "1 regression(s)" in text
    assert text.index("regression") < text.index("same")


@pytest.mark.parametrize(
    ("path", "value", "where"),
    [
        (("graphs", 0, "verified"), "no", "graphs[0].verified"),
        (("graphs", 1, "num_tokens"), None, "graphs[1].num_tokens"),
        (("graphs", 0, "memory_bytes"), -5, "graphs[0].memory_bytes"),
        (("totals", "all_verified"), "yes", "totals.all_verified"),
        (("warmup_audit", "violations"), "0", "warmup_audit.violations"),
    ],
)
def test_loading_checks_the_schema_and_names_the_field(path, value, where) -> None:
    data = json.loads(_report().to_json())
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ConfigError, match="does not match its schema") as info:
        CaptureReport.from_json(json.dumps(data))
    assert where in str(info.value)


def test_a_json_list_is_not_a_report() -> None:
    with pytest.raises(ConfigError, match="JSON object"):
        CaptureReport.from_json("[1, 2]")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model": "smollm2-135m"}, "model"),
        ({"spec": SpecInfo("ngram", 3)}, "spec"),
        ({"backend": "cuda"}, "backend"),
        ({"device": "NVIDIA H100"}, "device"),
    ],
)
def test_diff_refuses_reports_of_different_setups(change, field) -> None:
    with pytest.raises(ConfigError, match=f"not comparable: {field} "):
        diff_reports(_report(), replace(_report(), **change))


def test_an_unaudited_report_carries_no_counts_and_a_diff_says_the_audit_went_off() -> None:
    audited = _report()
    unaudited = replace(audited, warmup_audit=WarmupAudit(enabled=False))
    data = json.loads(unaudited.to_json())
    jsonschema.validate(data, report_schema(), cls=jsonschema.Draft202012Validator)
    assert data["warmup_audit"]["enabled"] is False
    assert {data["warmup_audit"][k] for k in ("steps", "passes", "slots_checked", "violations")} == {None}
    assert CaptureReport.from_json(unaudited.to_json()) == unaudited
    # Reports from before the field was added were audited.
    old = json.loads(audited.to_json())
    del old["warmup_audit"]["enabled"]
    assert CaptureReport.from_dict(old).warmup_audit.enabled

    console = Console(record=True, width=200)
    render(unaudited, console)
    text = console.export_text()
    assert "audit off" in text and "slots checked" not in text

    went_off = diff_reports(audited, unaudited)
    row = next(r for r in went_off.rows if r.metric == "warmup audit")
    assert (row.old, row.new, row.status) == ("0 violations", "off", "regression")
    assert not diff_reports(unaudited, unaudited).regressions
