"""``warmup accept``: acceptance read from vLLM-named counters, compared with a stored baseline.

The tiny-llama runs exercise the whole command (write, compare, regress, refuse) in seconds; the
SmolLM2 ones check the shipped baselines and that a ``warmup serve`` process measured over HTTP
gives exactly the in-process numbers (greedy on CPU is deterministic).
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import warmcap
from server_procs import cluster
from warmcap.accept import baseline as ab
from warmcap.accept import harness as acc
from warmcap.accept.counters import read_acceptance
from warmcap.cli import app
from warmcap.errors import WarmcapError
from warmcap.metrics import SpecDecodeMetrics
from warmcap.serve.metrics import ServingMetrics

runner = CliRunner()
TINY = ["--model", "tiny-llama", "--spec", "ngram:3"]


def invoke(*args: str):
    return runner.invoke(app, ["accept", *args, "--quiet"])


@pytest.fixture(scope="module")
def tiny_baseline(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("accept") / "tiny.json"
    res = invoke(*TINY, "--write-baseline", "--baseline", str(path), "--json")
    assert res.exit_code == 0, res.output
    return path


def doctored(src: Path, dst: Path, **changes) -> Path:
    data = json.loads(src.read_text())
    data.update(changes)
    dst.write_text(json.dumps(data))
    return dst


# ---- reading the counters ------------------------------------------------------------------------

drafts = st.lists(st.integers(1, 5).flatmap(lambda k: st.tuples(st.just(k), st.integers(0, k))), max_size=40)


def metrics_of(observations) -> SpecDecodeMetrics:
    m = SpecDecodeMetrics()
    for k, accepted in observations:
        m.observe(k, accepted)
    return m


@settings(max_examples=60, deadline=None)
@given(before=drafts, after=drafts)
def test_counters_read_back_exactly_and_rates_never_rise_with_position(before, after) -> None:
    first = metrics_of(before)
    both = metrics_of(before + after)
    reading = read_acceptance(both.to_prometheus({"model_name": "m"}))
    assert reading.num_drafts == both.num_drafts
    assert reading.num_draft_tokens == both.num_draft_tokens
    assert reading.num_accepted_tokens == both.num_accepted_tokens
    assert list(reading.accepted_per_pos) == both.accepted_per_pos
    assert reading.acceptance_length == pytest.approx(both.acceptance_length)
    rates = reading.per_position_rates
    assert all(a >= b for a, b in itertools.pairwise(rates))
    # A run is the counters' difference: exactly what the later observations alone would count.
    delta = reading.since(read_acceptance(first.to_prometheus()))
    alone = metrics_of(after)
    assert delta.num_drafts == alone.num_drafts
    assert delta.num_accepted_tokens == alone.num_accepted_tokens
    assert list(delta.padded(5).accepted_per_pos) == (alone.accepted_per_pos + [0] * 5)[:5]


def test_server_exposition_is_read_for_its_model_only() -> None:
    ours, theirs = metrics_of([(3, 2), (3, 0), (3, 3)]), metrics_of([(3, 3)] * 5)
    text = ServingMetrics("ours", lambda: ours, 3).render().decode()
    text += theirs.to_prometheus({"model_name": "theirs"})
    reading = read_acceptance(text, model_name="ours")
    assert (reading.num_drafts, reading.accepted_per_pos) == (3, [2, 2, 1])
    with pytest.raises(WarmcapError, match="no vllm:spec_decode_num_drafts_total counter"):
        read_acceptance("# nothing here\nup 1\n")


def test_compare_fails_a_drop_beyond_rtol_and_only_flags_a_rise() -> None:
    base = SpecDecodeMetrics(10, 30, 15, [8, 5, 2])
    assert ab.compare(base, base, 0.0).passed
    worse = SpecDecodeMetrics(10, 30, 14, [8, 5, 1])
    result = ab.compare(base, worse, 0.05)
    assert [c.status for c in result.checks] == ["PASS", "PASS", "PASS", "FAIL"]
    assert not result.passed
    # 4 % lower is inside 5 %: a tolerance, not a demand for equality.
    assert ab.compare(
        SpecDecodeMetrics(100, 300, 150, [80, 50, 20]), SpecDecodeMetrics(100, 300, 149, [80, 50, 19])
    ).passed
    better = ab.compare(worse, base, 0.05)
    assert better.passed and better.checks[-1].status == "HIGH"


# ---- the command on tiny-llama -------------------------------------------------------------------


def test_a_written_baseline_is_met_by_the_next_run(tiny_baseline: Path) -> None:
    stored = json.loads(tiny_baseline.read_text())
    assert stored["model"] == "tiny-llama"
    assert stored["spec"]["method"] == "ngram" and stored["spec"]["num_speculative_tokens"] == 3
    assert stored["prompt_set_sha256"] == acc.load_prompt_set().sha256
    assert stored["max_tokens"] == acc.DEFAULT_MAX_TOKENS
    assert stored["warmcap_version"] == warmcap.__version__
    assert stored["acceptance"]["num_drafts"] > 0, "the repetitive prompts must make ngram draft"

    res = invoke(*TINY, "--baseline", str(tiny_baseline), "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["passed"] and report["measured"] == stored["acceptance"]
    assert [c["status"] for c in report["checks"]] == ["PASS"] * 4


def test_a_position_raised_20_percent_in_the_baseline_fails_and_is_named(
    tiny_baseline: Path, tmp_path: Path
) -> None:
    data = json.loads(tiny_baseline.read_text())["acceptance"]
    counts = list(data["accepted_per_pos"])
    assert counts[0] > 0
    counts[0] = -(-counts[0] * 12 // 10)
    raised = SpecDecodeMetrics(data["num_drafts"], data["num_draft_tokens"], sum(counts), list(counts))
    path = doctored(tiny_baseline, tmp_path / "raised.json", acceptance=raised.as_dict())

    res = invoke(*TINY, "--baseline", str(path))
    assert res.exit_code == 1, res.output
    row = next(line for line in res.stdout.splitlines() if line.strip().startswith("position 0"))
    assert "FAIL" in row and f"{raised.per_position_rates[0]:.4f}" in row
    verdict = next(line for line in res.stdout.splitlines() if line.startswith("FAIL:"))
    assert "regressed beyond 5% at:" in verdict and "position 0" in verdict
    assert all("PASS" in line for line in res.stdout.splitlines() if line.strip().startswith("position 1"))


@pytest.mark.parametrize(
    ("args", "changes", "message"),
    [
        (["--model", "tiny-qwen3", "--spec", "ngram:3"], {}, "model 'tiny-llama' (this run: 'tiny-qwen3')"),
        (["--model", "tiny-llama", "--spec", "eagle:3"], {}, "spec ngram:3 (this run: eagle:3)"),
        ([*TINY, "--max-tokens", "8"], {}, "max_tokens 24 (this run: 8)"),
        (TINY, {"prompt_set_sha256": "0" * 64}, "prompt set 000000000000"),
        (TINY, {"format": 9}, "not a valid baseline (format 9, expected 1)"),
        (TINY, {"acceptance": {"num_drafts": 2}}, "not a valid baseline ('num_draft_tokens')"),
    ],
    ids=["model", "spec", "max-tokens", "prompt-set", "format", "truncated"],
)
def test_a_baseline_of_another_run_or_a_broken_one_is_exit_2(
    tiny_baseline: Path, tmp_path: Path, args, changes, message
) -> None:
    path = doctored(tiny_baseline, tmp_path / "b.json", **changes)
    started = time.monotonic()
    res = invoke(*args, "--baseline", str(path))
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.stderr.split()) and "Traceback" not in res.output
    assert time.monotonic() - started < 10, "a mismatch is refused before anything is measured"


def test_a_hand_edited_rate_or_a_missing_baseline_is_exit_2(tiny_baseline: Path, tmp_path: Path) -> None:
    data = json.loads(tiny_baseline.read_text())
    data["acceptance"]["per_position_rates"][0] += 0.2
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    res = invoke(*TINY, "--baseline", str(path))
    assert res.exit_code == 2 and "disagree with the counts: edit the counts" in res.stderr

    counts = data["acceptance"]["accepted_per_pos"]
    rising = SpecDecodeMetrics(
        data["acceptance"]["num_drafts"],
        data["acceptance"]["num_draft_tokens"],
        sum(counts),
        list(reversed(counts)),
    )
    assert rising.accepted_per_pos != counts
    path.write_text(json.dumps({**data, "acceptance": rising.as_dict()}))
    res = invoke(*TINY, "--baseline", str(path))
    assert res.exit_code == 2 and "rises with the position" in res.stderr

    res = invoke("--model", "tiny-llama", "--spec", "ngram:5")
    assert res.exit_code == 2
    assert "tiny-llama_ngram-5.json' does not exist (shipped: smollm2-135m_" in " ".join(res.stderr.split())
    assert "--write-baseline" in res.stderr
    assert invoke(*TINY, "--spec", "none").exit_code == 2


# ---- the shipped baselines -----------------------------------------------------------------------

SHIPPED = ["smollm2-135m_ngram-3.json", "smollm2-135m_draft_model-2.json"]


def test_shipped_baselines_describe_the_shipped_prompt_set() -> None:
    assert set(SHIPPED) <= set(ab.shipped_baselines())
    sha = acc.load_prompt_set().sha256
    kinds = {p.kind for p in acc.load_prompt_set().prompts}
    assert kinds == {"chat", "completion"}
    for name in SHIPPED:
        spec = acc.parse_spec(name.removeprefix("smollm2-135m_").removesuffix(".json").replace("-", ":"))
        path = ab.default_baseline_path("smollm2-135m", spec)
        base = ab.load_baseline(path)
        assert (base.model, base.prompt_set_sha256, base.spec) == (
            "smollm2-135m",
            sha,
            ab.spec_identity(spec),
        )
    ngram = ab.load_baseline(ab.default_baseline_path("smollm2-135m", acc.parse_spec("ngram:3")))
    rates = ngram.acceptance.per_position_rates
    assert len(rates) == 3 and all(0 < r < 1 for r in rates), rates
    # The model drafting for itself accepts every token (exact speculation), so any drop is a bug.
    self_draft = ab.load_baseline(ab.default_baseline_path("smollm2-135m", acc.parse_spec("draft_model:2")))
    assert self_draft.acceptance.per_position_rates == [1.0, 1.0]


# ---- SmolLM2: in-process against the shipped baselines, and a server ----------------------------

SERVE_ARGS = ["--enforce-eager", "--max-num-seqs", "1", "--max-model-len", "512", "--num-blocks", "66"]


@pytest.fixture(scope="module")
def smollm2_ngram() -> dict:
    res = invoke("--model", "smollm2-135m", "--spec", "ngram:3", "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_ngram_in_process_meets_its_shipped_baseline(smollm2_ngram: dict) -> None:
    assert smollm2_ngram["passed"]
    assert smollm2_ngram["baseline"].endswith("smollm2-135m_ngram-3.json")
    assert all(c["status"] == "PASS" for c in smollm2_ngram["checks"])


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_self_draft_in_process_meets_its_shipped_baseline() -> None:
    res = invoke("--model", "smollm2-135m", "--spec", "draft_model:2", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["passed"] and report["measured"]["per_position_rates"] == [1.0, 1.0]


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_through_warmup_serve_measures_what_in_process_measures(
    smollm2_ngram: dict, tmp_path: Path
) -> None:
    with cluster(tmp_path) as c:
        srv = c.serve("server", "smollm2-135m", "-q", "--spec", "ngram:3", *SERVE_ARGS)
        c.wait_ready(srv, timeout=600)
        url = srv.base_url
        # A server started with another setting is refused before any prompt is sent.
        other = invoke("--model", "smollm2-135m", "--spec", "draft_model:2", "--url", url)
        assert other.exit_code == 2 and "drafts with ngram:3 but --spec is draft_model:2" in other.stderr

        res = invoke("--model", "smollm2-135m", "--spec", "ngram:3", "--url", url, "--json")
        assert res.exit_code == 0, res.output
        report = json.loads(res.stdout)
        assert report["source"] == url
        assert report["measured"] == smollm2_ngram["measured"]
        assert report["completion_tokens"] == smollm2_ngram["completion_tokens"]
        assert report["passed"]
