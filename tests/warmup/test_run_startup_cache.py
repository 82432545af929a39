"""`warmup run --startup-cache` (the default) on a tiny model: the second start takes its verdicts
from the cache and says so per graph; `--no-startup-cache` neither reads nor writes it."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from warmcap.cli import app

runner = CliRunner()
RUN = ["run", "--model", "tiny-llama", "--spec", "eagle:2", "--max-num-seqs", "2", "--capture-sizes", "1,2,4"]


def _run(*extra: str) -> dict:
    res = runner.invoke(app, [*RUN, "--json", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _sources(report: dict) -> list[str]:
    return [g["verified_source"] for g in report["graphs"]]


def test_second_run_reuses_the_cache_and_no_startup_cache_ignores_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMCAP_STARTUP_CACHE", str(tmp_path / "cache"))
    first = _run()
    assert set(_sources(first)) == {"run"}
    assert list((tmp_path / "cache").glob("*.json"))

    second = _run()
    phases = {g["phase"] for g in second["graphs"]}
    assert _sources(second).count("run") == len(phases) and "cache" in _sources(second)
    assert all(g["verified"] for g in second["graphs"])
    # Same graphs, same verdicts and numbers: only where they came from differs.
    keep = (
        "phase",
        "num_tokens",
        "num_reqs",
        "verified",
        "max_abs_diff",
        "real_rows_max_abs_diff",
        "cuda_safe",
    )
    assert [{k: g[k] for k in keep} for g in second["graphs"]] == [
        {k: g[k] for k in keep} for g in first["graphs"]
    ]
    shown = runner.invoke(app, ["run", *RUN[1:]])
    assert shown.exit_code == 0 and "from the start-up cache" in " ".join(shown.output.split())

    monkeypatch.setenv("WARMCAP_STARTUP_CACHE", str(tmp_path / "unused"))
    off = _run("--no-startup-cache")
    assert set(_sources(off)) == {"run"}
    assert not (tmp_path / "unused").exists()
