"""The persistent start-up cache (``graphs/proof/startup_cache.py``): a warm start reuses verdicts and
reports the same graphs, any change to the key misses, a corrupt entry is rebuilt, and the spot
check catches a cached verdict that no longer holds."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch
from graph_fixtures import make_rig, tiny_llama

from warmcap.config import KERNEL_CHOICES, KernelConfig
from warmcap.graphs.capture import capturer as capture_module
from warmcap.graphs.proof import safety as safety_module
from warmcap.graphs.proof import startup_cache
from warmcap.graphs.proof.diff import diff_reports
from warmcap.graphs.proof.report import CaptureReport, schema_problem
from warmcap.graphs.proof.verify import verify_graphs
from warmcap.graphs.startup import GraphStartup, capture_graphs

WEIGHTS_BYTES = 2 << 20


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 32}))
    (d / "model.safetensors").write_bytes(b"\0" * WEIGHTS_BYTES)
    return d


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "startup-cache"


def start(cache_dir: Path, model_dir: Path, **rig) -> GraphStartup:
    """One start-up's graph capture on a fresh runner (same seeded weights every time)."""
    r = make_rig(k=1, **rig)
    return capture_graphs(r.runner, r.manager, backend="static", startup_cache=cache_dir, model_dir=model_dir)


def entry_file(cache_dir: Path) -> Path:
    (entry,) = cache_dir.glob("*.json")
    return entry


def sources(s: GraphStartup) -> dict[str, tuple[str, str]]:
    return {g.label: (g.verified_source, g.cuda_safe_source) for g in s.records}


def without_run_details(s: GraphStartup) -> list:
    """The records a user compares: sources and timings aside."""
    return [replace(g, capture_seconds=0.0, verified_source="run", cuda_safe_source="run") for g in s.records]


def test_a_warm_start_takes_verdicts_from_the_cache_and_reports_the_same_graphs(
    cache_dir, model_dir, monkeypatch
) -> None:
    cold = start(cache_dir, model_dir)
    assert all(src == ("run", "run") for src in sources(cold).values())
    assert cold.startup_cache is not None and cold.startup_cache.hits == 0

    # A warm start must not trace CUDA safety again: the check would fail loudly here.
    def no_trace(*args, **kwargs):
        raise AssertionError("CUDA safety traced although its verdict is cached")

    monkeypatch.setattr(safety_module, "check_graph_safe", no_trace)
    warm = start(cache_dir, model_dir)
    assert warm.startup_cache is not None and warm.startup_cache.hits > 0 and warm.startup_cache.misses == 0
    phases = {g.phase for g in warm.records}
    checked = [g for g in warm.records if g.verified_source == "run"]
    # One graph per phase is verified for real, every other verdict comes from the cache.
    assert sorted(g.phase for g in checked) == sorted(phases)
    assert len(warm.cached_checks) == len(warm.records) - len(phases)
    assert [g.cuda_safe_source for g in warm.records if g.cuda_safe is not None] == ["cache"] * len(phases)
    assert without_run_details(warm) == without_run_details(cold)
    assert warm.notes == cold.notes

    report = warm.report(model="tiny", device="cpu")
    assert schema_problem(report.to_dict()) == ""
    again = CaptureReport.from_json(report.to_json())
    assert [g.verified_source for g in again.graphs] == [g.verified_source for g in warm.records]
    diff = diff_reports(
        cold.report(model="tiny", device="cpu"), report, time_tolerance=1e9, memory_tolerance=1e9
    )
    assert not diff.has_regressions, diff


@pytest.mark.parametrize("record_max_tokens", [0, capture_module.RECORD_MAX_TOKENS])
def test_a_warm_static_capture_runs_no_forward_but_its_recordings_and_every_graph_still_replays_like_eager(
    cache_dir, model_dir, monkeypatch, record_max_tokens
) -> None:
    """With every output layout cached, a warm ``static`` capture only allocates the static outputs
    of the graphs it does not record, and runs one forward for each graph it records (a recording
    is a forward: ``graphs/capture/cpu_program.py``); replays fill them exactly as the cold start's
    did."""
    monkeypatch.setattr(capture_module, "RECORD_MAX_TOKENS", record_max_tokens)
    cold = start(cache_dir, model_dir)
    assert {kind for kind, _ in cold.result.order} == {"eager", "capture"}
    forwards = {"during_capture": 0}
    capturing = {"now": False}
    real_forward, real_capture = capture_module.GraphCapturer.forward, capture_module.GraphCapturer.capture

    def counted_forward(self, spec, metas):
        forwards["during_capture"] += capturing["now"]
        return real_forward(self, spec, metas)

    def flagged_capture(self, *args, **kwargs):
        capturing["now"] = True
        try:
            return real_capture(self, *args, **kwargs)
        finally:
            capturing["now"] = False

    monkeypatch.setattr(capture_module.GraphCapturer, "forward", counted_forward)
    monkeypatch.setattr(capture_module.GraphCapturer, "capture", flagged_capture)
    rig = make_rig(k=1)
    warm = capture_graphs(
        rig.runner, rig.manager, backend="static", startup_cache=cache_dir, model_dir=model_dir
    )
    recorded = [g.spec.label for g in warm.result.graphs if g.program is not None]
    assert recorded == [g.spec.label for g in warm.result.graphs if g.spec.num_tokens <= record_max_tokens]
    assert forwards["during_capture"] == len(recorded)
    assert {kind for kind, _ in warm.result.order} == {"capture"}
    assert [
        (g.spec.label, g.output.shape, g.output.dtype, [a.shape for a in g.aux]) for g in warm.result.graphs
    ] == [
        (g.spec.label, g.output.shape, g.output.dtype, [a.shape for a in g.aux]) for g in cold.result.graphs
    ]
    # Not only the spot-checked graphs: every allocated graph replays like eager.
    checks = verify_graphs(warm.capturer, warm.result.graphs, rig.manager)
    assert all(c.verified for c in checks), [c for c in checks if not c.verified]


def test_warm_starts_rotate_the_spot_check_over_every_graph(cache_dir, model_dir) -> None:
    cold = start(cache_dir, model_dir)
    per_phase = max(sum(g.phase == p for g in cold.records) for p in {g.phase for g in cold.records})
    checked: set[str] = set()
    for _ in range(per_phase):
        warm = start(cache_dir, model_dir)
        checked |= {g.label for g in warm.records if g.verified_source == "run"}
    assert checked == {g.label for g in cold.records}


def test_an_older_report_without_sources_still_loads_and_diffs(cache_dir, model_dir) -> None:
    data = start(cache_dir, model_dir).report(model="tiny", device="cpu").to_dict()
    for g in data["graphs"]:
        del g["verified_source"], g["cuda_safe_source"]
    old = CaptureReport.from_dict(data)
    assert {g.verified_source for g in old.graphs} == {"run"}
    assert not diff_reports(old, old).has_regressions


def _other_spec(cache_dir: Path, model_dir: Path) -> dict:
    return {"max_num_seqs": 2}


def _edit_one_weight(cache_dir: Path, model_dir: Path) -> dict:
    # One float of one weight, as a loader would give it: same files, same sizes, same mtimes.
    model = tiny_llama()
    with torch.no_grad():
        next(model.parameters()).view(-1)[7] += 1e-3
    return {"model": model}


def _edit_config(cache_dir: Path, model_dir: Path) -> dict:
    config = model_dir / "config.json"
    config.write_text(config.read_text().replace("32", "33"))
    return {}


def _new_source(cache_dir: Path, model_dir: Path) -> dict:
    return {}  # the test swaps the source digest


@pytest.mark.parametrize(
    "change", [_other_spec, _edit_one_weight, _edit_config, _new_source], ids=lambda f: f.__name__[1:]
)
def test_any_change_to_the_key_misses(cache_dir, model_dir, monkeypatch, change) -> None:
    start(cache_dir, model_dir)
    if change is _new_source:
        monkeypatch.setattr(startup_cache, "source_digest", lambda: "an edited warmcap")
    rig = change(cache_dir, model_dir)
    after = start(cache_dir, model_dir, **rig)
    assert after.startup_cache is not None and after.startup_cache.hits == 0
    assert all(src == ("run", "run") for src in sources(after).values())
    assert len(list(cache_dir.glob("*.json"))) == 2  # a second entry beside the first


def test_every_kernel_setting_misses_the_cache(cache_dir, model_dir) -> None:
    """Each setting that picks a forward's kernels (so its roundings) is a field of the config, and
    flipping any one of them, the CUDA fused ops and the ISA included, is a new key: a start never
    reuses a verdict proven on other kernels. The fields are read from the config itself, so a
    setting added later is covered without touching this test."""
    base = KernelConfig(**{name: allowed[0] for name, (allowed, _) in KERNEL_CHOICES.items()})
    start(cache_dir, model_dir, kernel=base)
    assert {f.name for f in fields(KernelConfig)} == set(KERNEL_CHOICES)
    for name, (allowed, _) in KERNEL_CHOICES.items():
        flipped = replace(base, **{name: allowed[1]})
        after = start(cache_dir, model_dir, kernel=flipped)
        assert after.startup_cache is not None and after.startup_cache.hits == 0, name
    # ... while the same settings again hit.
    again = start(cache_dir, model_dir, kernel=base)
    assert again.startup_cache is not None and again.startup_cache.hits > 0


def test_a_touch_that_changes_no_byte_still_hits(cache_dir, model_dir) -> None:
    """The key is the weights' content, never a file's modification time."""
    cold = start(cache_dir, model_dir)
    weights = model_dir / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    warm = start(cache_dir, model_dir)
    assert warm.startup_cache is not None and warm.startup_cache.misses == 0 and warm.cached_checks
    assert warm.startup_cache.key == cold.startup_cache.key


def test_the_weights_digest_is_their_bytes() -> None:
    model = tiny_llama()
    digest = startup_cache.weights_digest([model])
    assert startup_cache.weights_digest([tiny_llama()]) == digest
    # A module listed twice (a drafter sharing the target) is counted once.
    assert startup_cache.weights_digest([model, model]) == digest
    with torch.no_grad():
        last = list(model.parameters())[-1].view(-1)
        last[-1] = torch.nextafter(last[-1], torch.tensor(float("inf")))
    assert startup_cache.weights_digest([model]) != digest


def test_a_different_thread_count_misses(cache_dir, model_dir) -> None:
    start(cache_dir, model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        after = start(cache_dir, model_dir)
    finally:
        torch.set_num_threads(threads)
    assert after.startup_cache is not None and after.startup_cache.hits == 0


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda text: text[: len(text) // 2],
        lambda text: "\0\1garbage",
        lambda text: text.replace('"verified": true', '"verified": "yes"'),
        lambda text: text.replace('"checked_at"', '"when"'),
        lambda text: json.dumps([1, 2, 3]),
        lambda text: text.replace('"float32"', '"float99"'),
    ],
    ids=["truncated", "binary", "wrong_type", "missing_field", "not_an_object", "bad_layout_dtype"],
)
def test_a_corrupt_entry_is_ignored_with_a_warning_and_rebuilt(cache_dir, model_dir, caplog, corrupt) -> None:
    start(cache_dir, model_dir)
    entry = entry_file(cache_dir)
    entry.write_text(corrupt(entry.read_text()))
    with caplog.at_level(logging.WARNING, logger="warmcap.startup"):
        rebuilt = start(cache_dir, model_dir)
    assert any("ignored, it will be rebuilt" in r.getMessage() for r in caplog.records)
    assert any("ignored, it will be rebuilt" in n for n in rebuilt.notes)
    assert all(src == ("run", "run") for src in sources(rebuilt).values())
    assert all(c.verified for c in rebuilt.checks)
    # The rewritten entry serves the next start.
    warm = start(cache_dir, model_dir)
    assert warm.cached_checks and not any("rebuilt" in n for n in warm.notes)


def test_an_unwritable_cache_warns_and_starts_anyway(tmp_path, model_dir, caplog) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    with caplog.at_level(logging.WARNING, logger="warmcap.startup"):
        s = start(blocker, model_dir)
    assert all(c.verified for c in s.checks)
    assert any("could not be written" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("planted", ["verified", "max_abs_diff"])
def test_the_spot_check_catches_a_planted_cached_verdict_and_reverifies_all(
    cache_dir, model_dir, caplog, planted
) -> None:
    cold = start(cache_dir, model_dir)
    entry = entry_file(cache_dir)
    data = json.loads(entry.read_text())
    # The graph the next warm start checks first in its phase: the least recently checked.
    victim = cold.records[0].label
    data["checks"][victim]["checked_at"] = 0.0
    if planted == "verified":
        data["checks"][victim]["check"]["verified"] = False
    else:
        data["checks"][victim]["check"]["real_rows_max_abs_diff"] = 0.5
    entry.write_text(json.dumps(data))

    with caplog.at_level(logging.WARNING, logger="warmcap.startup"):
        warm = start(cache_dir, model_dir)
    assert any("stale" in r.getMessage() and victim in r.getMessage() for r in caplog.records)
    assert any("stale" in n for n in warm.notes)
    # Every graph was verified in this run, and the truth was written back.
    assert all(g.verified_source == "run" and g.verified for g in warm.records)
    fixed = json.loads(entry.read_text())["checks"][victim]["check"]
    assert fixed["verified"] is True and fixed["real_rows_max_abs_diff"] != 0.5


def test_a_planted_verdict_that_is_never_spot_checked_cannot_survive_rotation(cache_dir, model_dir) -> None:
    """A lie about any graph is found within as many warm starts as its phase has graphs."""
    cold = start(cache_dir, model_dir)
    victim = cold.records[-1]
    entry = entry_file(cache_dir)
    data = json.loads(entry.read_text())
    # The others were checked long before it, so every other graph of its phase is spot-checked
    # first; any warm start's time is still later than the victim's (no race with the clock).
    for label, check in data["checks"].items():
        if label != victim.label:
            check["checked_at"] -= 1000.0
    data["checks"][victim.label]["check"]["verified"] = False
    entry.write_text(json.dumps(data))
    per_phase = sum(g.phase == victim.phase for g in cold.records)
    found = False
    for _ in range(per_phase):
        warm = start(cache_dir, model_dir)
        found = found or any("stale" in n for n in warm.notes)
    assert found
    assert all(g.verified for g in start(cache_dir, model_dir).records)


def test_compile_points_inductor_into_the_cache_unless_the_user_chose(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    startup_cache.enable_compile_cache(tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/users/own/dir")
    startup_cache.enable_compile_cache(tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/users/own/dir"
