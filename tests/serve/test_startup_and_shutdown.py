"""Start-up that must not serve, self-drafting counters, and shutdown by signal (a real process)."""

from __future__ import annotations

import re
import shutil
import signal
import threading
from pathlib import Path

import httpx
import openai
import pytest
from safetensors.torch import load_file, save_file
from serve_fixtures import metric, running
from typer.testing import CliRunner

import warmcap.warmup.hook
from server_procs import cluster, free_port
from warmcap.audit.kv_writes import Violation
from warmcap.cli import app as cli_app
from warmcap.config import StartupOptions
from warmcap.llm import build_config
from warmcap.models.presets import resolve_model_path
from warmcap.serve import ServeOptions, build_app

SMALL = ["--model", "tiny-llama", "--num-blocks", "128", "--capture-sizes", "1,2", "--max-num-seqs", "4"]


def test_self_drafting_moves_spec_counters() -> None:
    config = build_config(
        "tiny-llama",
        num_blocks=128,
        max_model_len=128,
        max_num_seqs=4,
        speculative_config="draft_model:2",
        device="cpu",
    )
    with running(build_app(config, ServeOptions(startup=StartupOptions(capture_sizes=(1, 3))))) as srv:
        srv.wait_ready()
        before = srv.metrics()
        assert [
            metric(before, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=p) for p in "01"
        ] == [0, 0]
        srv.client().completions.create(
            model="tiny-llama", prompt="Once upon a time", max_tokens=20, temperature=0
        )
        m = srv.metrics()
        drafts = metric(m, "vllm:spec_decode_num_drafts_total")
        accepted = metric(m, "vllm:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and accepted > 0
        # A model drafting for itself has every draft accepted unless max_tokens cuts the last one.
        engine_figure = srv.state.loop.engine.spec_metrics.acceptance_length
        assert 1 + accepted / drafts == pytest.approx(engine_figure)
        assert engine_figure > 2.0


def test_audit_violation_keeps_server_from_ready(monkeypatch) -> None:
    real_run_warmup = warmcap.warmup.hook.run_warmup

    def stray_write(*args, **kwargs):
        result = real_run_warmup(*args, **kwargs)
        result.audit.violations.append(
            Violation(
                "decode_spec", "draft", "warmup-0", "full", 37, 5, 0, "block 0 is not held by the request"
            )
        )
        return result

    monkeypatch.setattr(warmcap.warmup.hook, "run_warmup", stray_write)
    result = CliRunner().invoke(cli_app, ["serve", *SMALL, "--port", str(free_port())])
    assert result.exit_code == 1, result.output
    assert "did not become ready" in result.output and "stray KV write" in result.output
    assert "Traceback" not in result.output


def test_serve_enforce_eager_becomes_ready_with_no_graphs_and_audits_serving(monkeypatch) -> None:
    import warmcap.serve.server

    seen = {}

    def capture(config, options, *, host, port, model_threads=None):
        seen.update(config=config, options=options)

    monkeypatch.setattr(warmcap.serve.server, "serve", capture)
    args = ["serve", *SMALL, "--enforce-eager", "--audit-serving", "--port", str(free_port())]
    result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 0, result.output
    with running(build_app(seen["config"], seen["options"])) as srv:
        srv.wait_ready()
        startup = httpx.get(srv.base_url + "/startup").json()
        assert startup["backend"] == "eager" and startup["graphs"] == []
        engine = srv.state.loop.engine
        assert engine.runner.graphs is None
        audit = engine.serving_audit.totals
        steps_before = audit.steps
        done = srv.client().completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=8)
        assert done.choices[0].text
        # every step of the request was audited (one per token with no drafts), all clean
        assert audit.ok and audit.steps - steps_before >= 8 and audit.slots_checked > 0
        # ... and the counts are visible, in /metrics and in /startup, not only inferred from silence
        m = srv.metrics()
        assert metric(m, "warmcap:serving_audit_enabled") == 1
        assert metric(m, "warmcap:serving_audit_steps_total") == audit.steps
        assert metric(m, "warmcap:serving_audit_slots_checked_total") == audit.slots_checked > 0
        assert metric(m, "warmcap:serving_audit_violations_total") == 0
        counts = httpx.get(srv.base_url + "/startup").json()["serving_audit"]
        assert counts == {"steps": audit.steps, "slots_checked": audit.slots_checked, "violations": 0}


def test_serve_on_cpu_by_default_replays_recorded_decode_graphs(monkeypatch) -> None:
    """No graph flag: the decode graphs a CPU graph records (the ladder up to 32 tokens, decode steps
    padded to it), all verified and recorded, no mixed graph; requests replay them."""
    import warmcap.serve.server

    seen = {}

    def capture(config, options, *, host, port, model_threads=None):
        seen.update(config=config, options=options)

    monkeypatch.setattr(warmcap.serve.server, "serve", capture)
    args = ["serve", "--model", "tiny-llama", "--num-blocks", "128", "--max-num-seqs", "16"]
    result = CliRunner().invoke(cli_app, [*args, "--port", str(free_port())])
    assert result.exit_code == 0, result.output
    assert not seen["config"].model.enforce_eager
    with running(build_app(seen["config"], seen["options"])) as srv:
        srv.wait_ready()
        startup = httpx.get(srv.base_url + "/startup").json()
        assert startup["backend"] == "static" and startup["capture_sizes"] == [1, 2, 4, 8, 16, 24, 32]
        # 16 sequences: decode graphs of 1, 2, 4, 8 and 16 requests; every one recorded and verified
        assert startup["totals"]["count"] == 5 and startup["totals"]["all_verified"]
        assert any("5 of 5 graphs replay a recorded program" in n for n in startup["notes"])
        graphs = srv.state.loop.engine.runner.graphs
        before = sum(graphs.replays.values())
        done = srv.client().completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=8)
        assert done.choices[0].text
        assert sum(graphs.replays.values()) > before


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_ends_inflight_requests_with_an_error_and_exits_0(
    sig: signal.Signals, tmp_path: Path
) -> None:
    with cluster(tmp_path) as c:
        srv = c.serve("server", "tiny-llama", *SMALL[2:], "--max-model-len", "1024")
        c.wait_ready(srv)
        client = srv.client()
        streaming = threading.Event()
        outcome: list[BaseException | str] = []

        def long_stream() -> None:
            try:
                stream = client.completions.create(
                    model="tiny-llama",
                    prompt="Go on:",
                    max_tokens=1000,
                    extra_body={"ignore_eos": True},
                    temperature=0,
                    stream=True,
                )
                for _ in stream:
                    streaming.set()
                outcome.append("finished without error")
            except Exception as exc:
                outcome.append(exc)
            finally:
                streaming.set()

        thread = threading.Thread(target=long_stream)
        thread.start()
        assert streaming.wait(60)
        srv.process.send_signal(sig)
        thread.join(60)
        assert srv.process.wait(60) == 0
        assert len(outcome) == 1 and isinstance(outcome[0], openai.APIError), outcome
        assert "shutting down" in str(outcome[0])
        log = srv.log.read_text()
        stopped = re.search(r"engine stopped; (\d+) of (\d+) KV blocks free", log)
        assert stopped and stopped.group(1) == stopped.group(2), log[-2000:]


def test_serve_with_an_unusable_model_exits_2(tmp_path: Path) -> None:
    """The CLI's one rule for a model given that cannot be used (here: one whose logits are NaN,
    found by start-up's smoke generation): exit 2, as ``warmup generate`` exits for it and for a
    missing or unloadable model (``tests/test_engine_safety.py``)."""
    nan = tmp_path / "nan-llama"
    shutil.copytree(resolve_model_path("tiny-llama"), nan)
    weights = load_file(nan / "model.safetensors")
    save_file(
        {k: v.fill_(float("nan")) if "norm" in k else v for k, v in weights.items()},
        nan / "model.safetensors",
    )
    args = ["serve", *SMALL[2:], "--model", str(nan), "--enforce-eager", "--port", str(free_port())]
    result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 2, result.output
    assert "non-finite" in result.output and "nan-llama" in result.output
    assert "Traceback" not in result.output


def test_proxy_exits_0_on_sigterm(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        gone = f"http://127.0.0.1:{free_port()}"
        proxy = c._start("proxy", ["proxy", "--prefill", gone, "--decode", gone])
        assert proxy.health() == 502  # serving, with neither server up
        proxy.process.send_signal(signal.SIGTERM)
        assert proxy.process.wait(30) == 0, proxy.log_tail()
