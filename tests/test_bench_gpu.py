"""``benchmarks/bench_gpu.py --smoke``: every peer runs on CPU on a tiny preset, tokens compared,
so the GPU benchmark is ready to run in one call when a GPU is lent (its numbers here mean nothing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_gpu_smoke_runs_every_peer_and_compares_tokens(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("bench_gpu", None)
    import bench_gpu

    out = tmp_path / "rows.json"
    assert bench_gpu.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["peer"], r["batch"]) for r in rows] == [
        (peer, batch)
        for batch in (1, 2)
        for peer in ("warmcap_graphs", "warmcap_eager", "hf_generate", "hf_static_nocompile")
    ]
    # Greedy float32 on the same weights: every peer's tokens equal warmcap's graphs.
    assert all(r["identical_rows"] == r["batch"] and r["first_difference"] is None for r in rows)
    assert all(r["tok_s"] > 0 and r["ms_per_step"] is not None for r in rows)
    assert all(r["kernels_per_step"] is None for r in rows)  # counted on CUDA only
    printed = capsys.readouterr().out
    assert "tokens vs warmcap_graphs" in printed and "2/2 identical" in printed


def test_bench_gpu_refuses_cuda_without_it_and_bad_arguments(monkeypatch, capsys) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("bench_gpu", None)
    import bench_gpu

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert bench_gpu.main(["--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_gpu.main(["--smoke", "--peers", "vllm"])
    assert "unknown peer" in capsys.readouterr().err
