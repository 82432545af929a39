"""`warmup run --startup-cache` (the default) on a tiny model: the second start takes its verdicts
from the cache and says so per graph; `--no-startup-cache` neither reads nor writes it and proves
every verdict in the run; one changed weight byte is a new key."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

from typer.testing import CliRunner

from warmcap.cli import app

runner = CliRunner()
RUN = ["run", "--model", "tiny-llama", "--spec", "eagle:2", "--max-num-seqs", "2", "--capture-sizes", "1,2,4"]


def _run(*extra: str, base: list[str] = RUN) -> dict:
    res = runner.invoke(app, [*base, "--json", *extra])
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
    monkeypatch.setenv("WARMCAP_STARTUP_CACHE", str(tmp_path / "cache"))
    off = _run("--no-startup-cache")
    # The warm entry is right there, and still nothing comes from it: full proof.
    assert set(_sources(off)) == {"run"}
    assert {g["cuda_safe_source"] for g in off["graphs"]} == {"run"}
    assert off["startup_cache"] == {
        "enabled": False,
        "entry": None,
        "weights_digest": None,
        "verified_from_cache": [],
        "cuda_safe_from_cache": [],
        "stale": False,
    }
    shown_off = runner.invoke(app, ["run", *RUN[1:], "--no-startup-cache"])
    assert shown_off.exit_code == 0
    assert "off: every verdict was proven in this run" in " ".join(shown_off.output.split())
    monkeypatch.setenv("WARMCAP_STARTUP_CACHE", str(tmp_path / "unused"))
    _run("--no-startup-cache")
    assert not (tmp_path / "unused").exists()


def _flip_lowest_bit(weights: Path) -> bytes:
    """Flip the lowest bit of one float32 weight in a safetensors file in place (same size), put
    its modification time back, and return the file's old bytes."""
    old = weights.read_bytes()
    st = weights.stat()
    (n,) = struct.unpack("<Q", old[:8])
    header = json.loads(old[8 : 8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    at = 8 + n + header[name]["data_offsets"][0]
    new = bytearray(old)
    new[at] ^= 1
    weights.write_bytes(bytes(new))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_mtime_ns == st.st_mtime_ns and weights.stat().st_size == st.st_size
    return old


def test_one_weight_byte_changed_at_the_same_mtime_misses_the_cache(tmp_path, monkeypatch):
    """The cache is keyed on the weights' bytes: one flipped bit with size and mtime kept is a new
    key (every verdict proven again); the original bytes back, the first entry serves again."""
    from warmcap.models.presets import resolve_model

    monkeypatch.setenv("WARMCAP_STARTUP_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "tiny"
    shutil.copytree(resolve_model("tiny-llama"), model)
    run = ["run", "--model", str(model), *RUN[3:]]
    cold = _run(base=run)
    assert cold["startup_cache"]["enabled"] and cold["startup_cache"]["verified_from_cache"] == []

    (weights,) = model.glob("*.safetensors")
    original = _flip_lowest_bit(weights)
    st = weights.stat()
    edited = _run(base=run)
    assert set(_sources(edited)) == {"run"} and edited["startup_cache"]["verified_from_cache"] == []
    assert edited["startup_cache"]["weights_digest"] != cold["startup_cache"]["weights_digest"]
    assert all(g["verified"] for g in edited["graphs"])

    weights.write_bytes(original)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    restored = _run(base=run)
    assert restored["startup_cache"]["weights_digest"] == cold["startup_cache"]["weights_digest"]
    assert "cache" in _sources(restored)
    assert sorted(restored["startup_cache"]["verified_from_cache"]) == sorted(
        g_label(g) for g in restored["graphs"] if g["verified_source"] == "cache"
    )


def g_label(g: dict) -> str:
    """A graph's label as the report prints it (``GraphRecord.label``)."""
    from warmcap.graphs.proof.report import GraphRecord

    return GraphRecord(**g).label
