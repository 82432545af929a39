from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from warmcap.cli import app
from warmcap.warmup.plan_view import plan_schema

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_readme_opens_with_the_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(block) == 2
    main_cmd, test_cmd = block
    assert "warmup run" in main_cmd and "pytest" in test_cmd
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci
    assert "HF_HUB_OFFLINE=1" in ci and "TRITON_INTERPRET=1" in ci


def test_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("warmcap ")


def test_plan_json_follows_the_documented_schema():
    res = runner.invoke(
        app, ["plan", "--model", "tiny-llama", "--spec", "eagle3:3", "--json", "--num-blocks", "64"]
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    jsonschema.validate(data, plan_schema())
    assert data["spec"] == {"method": "eagle3", "num_speculative_tokens": 3}
    assert data["num_lookahead_tokens"] == 3


def test_plan_table_names_every_step_and_the_blocks():
    res = runner.invoke(app, ["plan", "--model", "tiny-llama", "--spec", "dflash:7", "--num-blocks", "64"])
    assert res.exit_code == 0, res.output
    for step in ("prefill", "decode_all_spec", "boundary_decode_0", "mixed_prefill_decode"):
        assert step in res.output
    assert "lookahead=8" in res.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--spec", "eagle3:x"], "K must be an integer"),
        (["--spec", "medusa:2"], "unknown speculative method"),
        (["--spec", "dflash:7", "--num-blocks", "2", "--block-size", "8"], "Raise --num-blocks to at least"),
        (["--block-size", "12"], "power of two"),
        (["--model", "/nonexistent/model"], "neither a preset nor a directory"),
        (
            ["--max-prefill-tokens-with-decodes", "32", "--no-enable-chunked-prefill"],
            "max_prefill_tokens_with_decodes=32 needs chunked prefill",
        ),
        (["--max-prefill-tokens-with-decodes", "-3"], "or 0 for no cap; got -3"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(args, needle):
    res = runner.invoke(app, ["plan", "--model", "tiny-llama", *args])
    assert res.exit_code == 2
    assert needle in " ".join(res.output.split())
    assert "Traceback" not in res.output


def test_run_report_and_diff_round_trip(tmp_path):
    """`warmup run` on a tiny model: clean audit, every graph verified, a report that renders, and a
    diff that flags an injected regression with a non-zero exit."""
    out = tmp_path / "report.json"
    res = runner.invoke(
        app,
        [
            "run",
            "--model",
            "tiny-llama",
            "--spec",
            "eagle:2",
            "--max-num-seqs",
            "2",
            "--capture-sizes",
            "1,2,4,8",
            "--out",
            str(out),
            "--strict",
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["warmup_audit"]["violations"] == 0 and data["warmup_audit"]["slots_checked"] > 0
    assert data["graphs"] and all(g["verified"] for g in data["graphs"])
    assert {"decode", "draft_decode"} <= {g["phase"] for g in data["graphs"]}

    shown = runner.invoke(app, ["report", str(out)])
    assert shown.exit_code == 0 and "no stray KV write" in shown.output

    worse = json.loads(out.read_text())
    worse["warmup_audit"]["violations"] = 3
    worse_path = tmp_path / "worse.json"
    worse_path.write_text(json.dumps(worse))
    same = runner.invoke(app, ["report", "--diff", str(out), str(out)])
    assert same.exit_code == 0, same.output
    flagged = runner.invoke(app, ["report", "--diff", str(out), str(worse_path)])
    assert flagged.exit_code == 1


def test_report_of_a_missing_file_is_a_clear_error(tmp_path):
    res = runner.invoke(app, ["report", str(tmp_path / "nope.json")])
    assert res.exit_code == 2 and "does not exist" in " ".join(res.output.split())


def _one_error_line(res) -> str:
    """The error on stderr: exactly one line (never wrapped), no traceback."""
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error:") and "Traceback" not in res.output
    return lines[0]


def _tiny_report_json() -> dict:
    from warmcap.graphs.proof.report import CaptureReport, GraphRecord, SpecDecodeStats, SpecInfo, WarmupAudit

    report = CaptureReport(
        model="tiny-llama",
        device="cpu",
        backend="static",
        spec=SpecInfo("eagle", 1),
        capture_sizes=[1, 2],
        graphs=[GraphRecord("decode", "FULL", 2, 1, 2, 0.1, 1 << 20, True, 0.0, 0.0, True)],
        warmup_audit=WarmupAudit(steps=1, passes=1, slots_checked=4, violations=0),
        spec_decode=SpecDecodeStats(
            num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0, per_position=[0]
        ),
        timings={},
        notes=[],
    )
    return json.loads(report.to_json())


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "not text"),
        (b"{not json", "not valid JSON"),
        (b"[1, 2, 3]", "JSON object"),
    ],
)
def test_report_of_a_broken_file_is_one_line_exit_2(tmp_path, content, says):
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    res = runner.invoke(app, ["report", str(bad)])
    assert res.exit_code == 2
    assert says in _one_error_line(res) and "bad.json" in res.output


def test_report_with_wrong_types_is_refused(tmp_path):
    data = _tiny_report_json()
    data["graphs"][0]["verified"] = "no"
    bad = tmp_path / "typed.json"
    bad.write_text(json.dumps(data))
    res = runner.invoke(app, ["report", str(bad)])
    assert res.exit_code == 2 and "graphs[0].verified" in _one_error_line(res)


def test_report_diff_of_different_models_refuses(tmp_path):
    old = _tiny_report_json()
    new = dict(old, model="smollm2-135m")
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    res = runner.invoke(app, ["report", "--diff", str(tmp_path / "old.json"), str(tmp_path / "new.json")])
    assert res.exit_code == 2
    line = _one_error_line(res)
    assert "not comparable" in line and "model 'tiny-llama' vs 'smollm2-135m'" in line
    assert "no regressions" not in res.output.lower()


@pytest.mark.parametrize("where", ["missing/report.json", "."])
def test_run_checks_out_path_before_the_run(tmp_path, monkeypatch, where):
    import warmcap.startup

    def no_run(*args, **kwargs):
        raise AssertionError("the run started although --out cannot be written")

    monkeypatch.setattr(warmcap.startup, "run_startup", no_run)
    out = tmp_path / where
    res = runner.invoke(app, ["run", "--model", "tiny-llama", "--out", str(out)])
    assert res.exit_code == 2
    line = _one_error_line(res)
    assert "--out" in line and ("does not exist" in line or "is a folder" in line)


def test_num_blocks_beyond_memory_is_refused_on_one_line():
    res = runner.invoke(app, ["run", "--model", "tiny-llama", "--num-blocks", "100000000"])
    assert res.exit_code == 2
    line = _one_error_line(res)
    assert "--num-blocks 100000000 needs" in line and "GiB" in line


def test_plan_blames_max_model_len_not_the_pool_when_the_pool_is_big():
    res = runner.invoke(app, ["plan", "--model", "tiny-llama", "--num-blocks", "512", "--max-model-len", "2"])
    assert res.exit_code == 2
    line = _one_error_line(res)
    assert "raise --max-model-len" in line and "Raise --num-blocks" not in line


def test_plan_pool_advice_is_a_size_that_works():
    base = ["plan", "--model", "tiny-llama", "--spec", "dflash:7"]
    res = runner.invoke(app, [*base, "--num-blocks", "6"])
    assert res.exit_code == 2
    want = int(re.search(r"Raise --num-blocks to at least (\d+)", _one_error_line(res)).group(1))
    assert want > 6
    assert runner.invoke(app, [*base, "--num-blocks", str(want)]).exit_code == 0
    assert runner.invoke(app, [*base, "--num-blocks", str(want - 1)]).exit_code == 2


def test_run_json_stdout_is_only_json_and_progress_stays_off_the_pipe():
    res = runner.invoke(
        app,
        [
            "run",
            "--model",
            "tiny-llama",
            "--spec",
            "none",
            "--max-num-seqs",
            "1",
            "--capture-sizes",
            "1",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["model"] == "tiny-llama" and report["graphs"]
    # stderr is not a terminal here: no progress frames, no control codes.
    assert "\x1b[" not in res.stderr and "capture graphs" not in res.stderr


def test_quiet_and_verbose_together_are_refused_on_one_line():
    res = runner.invoke(app, ["run", "--model", "tiny-llama", "--quiet", "--verbose"])
    assert res.exit_code == 2
    assert "--quiet and --verbose" in res.output and "Traceback" not in res.output


def test_generate_sizes_start_up_from_the_request_and_matches_a_full_sized_engine():
    """One prompt starts an engine of one sequence and a context of prompt + max_tokens (logged with
    --verbose); its greedy text equals an engine sized for the model's full context, with graphs or
    without."""
    from warmcap.llm import LLM
    from warmcap.sampling_params import SamplingParams

    prompt = "The capital of France is"
    args = ["generate", "--model", "tiny-llama", "--prompt", prompt, "--no-chat", "--max-tokens", "12"]
    res = runner.invoke(app, [*args, "--verbose"])
    assert res.exit_code == 0, res.output
    llm = LLM("tiny-llama", max_model_len=512, max_num_seqs=4, enforce_eager=True)
    ids = llm.tokenizer.encode(prompt)
    expected = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=12))[0].text
    assert res.stdout.rstrip("\n") == expected
    wanted = -(-(len(ids) + 12) // 16) * 16
    assert f"max_model_len {wanted}" in " ".join(res.stderr.split())

    # On CPU the default is eager (the static backend replays eager code); graphs on request.
    assert "graph_verify done" not in res.stderr
    graphs = runner.invoke(app, [*args, "--capture-graphs", "--num-blocks", "8", "--quiet"])
    assert graphs.exit_code == 0, graphs.output
    assert graphs.stdout.rstrip("\n") == expected
    assert graphs.stderr == ""
