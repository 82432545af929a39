"""The ``warmup`` command."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from warmcap import __version__
from warmcap.cli_options import (
    GENERATE,
    SERVE,
    STARTUP,
    Backend,
    CaptureSizes,
    Html,
    Model,
    Quiet,
    Spec,
    Verbose,
    engine_options,
    startup_options,
    takes_startup_options,
)
from warmcap.cli_options import STARTUP_DEFAULTS as _SD
from warmcap.config import StartupOptions
from warmcap.errors import ConfigError, WarmcapError

app = typer.Typer(
    name="warmup",
    help="Plan, run and verify an LLM engine's start-up: warmup, KV-write audit, graph capture.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# NOTE: messages go through rich.markup.escape: an audit sample's "[draft_step_0]" is not markup.
# NOTE: soft wrap: rich otherwise folds long lines at the terminal width (80 columns when stderr
# is not a terminal), and an error must stay one line for whoever greps the log.
err = Console(stderr=True, soft_wrap=True)
EXIT_USAGE = 2


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a :class:`WarmcapError` into one red line and exit code 2 — never a traceback."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except WarmcapError as exc:
            err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
            raise typer.Exit(EXIT_USAGE) from None

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"warmcap {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """warmcap: start-up you can trust."""


def main() -> None:
    """Console-script entry point."""
    try:
        code = app()
    except SystemExit as exc:
        code = exc.code
    _exit(code)


def _exit(code: object) -> None:
    """End the process with ``code`` once the command is done, skipping the interpreter's teardown.

    Tearing down torch, transformers and a loaded engine module by module takes about a second
    (measured in BENCHMARKS.md, "Start-up, 2026-12-03, part 2") and frees nothing the operating
    system does not free at exit anyway. Exit handlers still run and the standard streams are
    flushed; a command that left threads running, an exit code that is not a number or a stream
    that cannot be flushed takes the ordinary exit.
    """
    import atexit
    import os
    import threading

    if code is None:
        code = 0
    if not isinstance(code, int) or threading.active_count() > 1:
        sys.exit(code)
    # NOTE: os._exit skips whatever the interpreter would do after the exit handlers (module
    # teardown, __del__ of what is still alive): nothing warmcap relies on at exit lives there.
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        # A closed pipe (e.g. `| head`): the ordinary exit reports it as it always did.
        sys.exit(code)
    os._exit(code)


# ---- shared options ------------------------------------------------------------------------------


@contextmanager
def _watched_startup(*, quiet: bool, verbose: bool) -> Iterator[None]:
    """Show start-up progress on stderr (terminal only, never with ``quiet``) and route the
    ``warmcap`` log there; engines started inside report to it. stdout stays the command's own."""
    from warmcap.progress import StartupProgress, configure_logging, log_level
    from warmcap.startup_hooks import observing

    _one_of(quiet=quiet, verbose=verbose)
    configure_logging(err, log_level(quiet=quiet, verbose=verbose))
    with StartupProgress(err, enabled=not quiet) as progress, observing(progress):
        yield


def _one_of(*, quiet: bool, verbose: bool) -> None:
    if quiet and verbose:
        raise WarmcapError("--quiet and --verbose contradict each other: pass at most one")


def engine_config(model: str, values: dict[str, Any]):
    """The :class:`EngineConfig` of an engine command: every engine option it was given (its own
    parameters and those ``cli_options.engine_options`` added), through the one table of
    ``engine_args.py``, as ``LLM(model, **values)`` would build it."""
    from warmcap.engine_args import ARGS_BY_NAME, build_config

    return build_config(model, **{k: v for k, v in values.items() if k in ARGS_BY_NAME and v is not None})


def _worker_if_launched(tensor_parallel_size: int, *, quiet: bool, verbose: bool) -> None:
    """Under a launcher (``RANK`` > 0 in the environment) an engine command is a worker rank: the
    same command line then runs on every rank, as torchrun starts it (docs/parallel.md)."""
    from warmcap.distributed.launch import is_launched_worker

    if tensor_parallel_size > 1 and is_launched_worker():
        raise typer.Exit(_run_worker(quiet=quiet, verbose=verbose))


def _run_worker(*, quiet: bool, verbose: bool, timeout_s: float | None = None) -> int:
    from logging import INFO

    from warmcap.distributed.launch import run_launched_worker
    from warmcap.progress import configure_logging, log_level

    _one_of(quiet=quiet, verbose=verbose)
    configure_logging(err, log_level(quiet=quiet, verbose=verbose, default=INFO))
    return run_launched_worker(timeout_s=timeout_s)


# ---- warmup plan ---------------------------------------------------------------------------------


@app.command()
@_user_errors
@engine_options(STARTUP)
def plan(
    model: Model = "smollm2-135m",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the plan as JSON (schema: docs/warmup.md).")
    ] = False,
    html: Html = None,
    capture_sizes: CaptureSizes = None,
    backend: Backend = _SD.backend,
    serve_defaults: Annotated[
        bool,
        typer.Option(
            "--serve",
            help="Plan with `warmup serve`'s defaults (no speculation, the model's context, vLLM's "
            "serving sequences and step budget for the device) for every option not given.",
        ),
    ] = False,
    *,
    ctx: typer.Context,
    **engine: Any,
) -> None:
    """Plan warmup exactly as start-up will — same config, KV groups and pool — with no weights loaded.

    Takes every engine option of `warmup run` with the same defaults, so `warmup plan` with a run's
    flags prints the plan that run executes; with --serve, the plan `warmup serve` with the same
    flags executes. --html also draws the graphs that run captures (--capture-sizes, --backend as
    for `warmup run`; --backend cuda shows a GPU run's graphs from any machine).
    """
    import json
    from dataclasses import replace

    from warmcap.assembly import assemble_for_plan
    from warmcap.cli_options import option_default
    from warmcap.warmup.plan_view import render_plan
    from warmcap.warmup.planner import plan_warmup

    if serve_defaults:
        for name in engine:
            # NOTE: by name: typer carries its own copy of click, whose enum is not click's.
            source = ctx.get_parameter_source(name)
            if source is not None and source.name == "DEFAULT":
                engine[name] = option_default(name, SERVE)
        engine = serving_engine_values(engine)
        source = ctx.get_parameter_source("enforce_eager")
        if source is not None and source.name == "DEFAULT":
            engine["enforce_eager"] = None
    # Checked as `warmup run` checks them (one record), though only the page shows the graphs they shape.
    startup = startup_options(backend=backend, capture_sizes=capture_sizes)
    if serve_defaults:
        engine, startup = serving_graphs(engine, startup)
    config = engine_config(model, engine)
    if config.tensor_parallel_size > 1:
        _refuse_unshardable(model, config.tensor_parallel_size)
    # Rank 0 makes the plan and every rank runs it: the one-device plan (shapes, not shards).
    assembly = assemble_for_plan(replace(config, tensor_parallel_size=1))
    if html:
        _check_out_path(html, "--html")
    result = plan_warmup(assembly.config, assembly.kv_groups, assembly.num_blocks)
    if html:
        from warmcap.assembly import resolve_device
        from warmcap.graphs.capture.capturer import planned_capture
        from warmcap.pages.write import write_plan_page

        drafter = assembly.drafter
        graphs = planned_capture(
            assembly.config,
            assembly.kv_groups,
            None if drafter is None else drafter.draft_model,
            device=resolve_device(assembly.config.model.device),
            backend=startup.backend,
            capture_sizes=None if startup.capture_sizes is None else list(startup.capture_sizes),
            graph_shapes=startup.graph_shapes or "all",
        )
        write_plan_page(html, result, graphs)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=1))
    else:
        render_plan(result, Console())


def serving_engine_values(engine: dict[str, Any]) -> dict[str, Any]:
    """``engine`` with the batch limits left unset filled as ``warmup serve`` fills them: vLLM's
    OpenAI-server defaults for the device (``engine_args.serving_batch_defaults``), and never more
    sequences than tokens a step; with chunked prefill, the device's prompt allowance beside
    decodes (none on CUDA)."""
    from warmcap.engine_args import serving_batch_defaults

    seqs, tokens, allowance = serving_batch_defaults(engine["device"], engine["tensor_parallel_size"])
    out = dict(engine)
    if out.get("max_num_batched_tokens") is None:
        out["max_num_batched_tokens"] = tokens
    if out.get("max_num_seqs") is None:
        out["max_num_seqs"] = min(seqs, out["max_num_batched_tokens"])
    if out.get("max_prefill_tokens_with_decodes") is None and out.get("enable_chunked_prefill", True):
        out["max_prefill_tokens_with_decodes"] = allowance
    return out


def serving_enforce_eager(device: str) -> bool:
    """``warmup generate``'s graph default: eager on CPU, graphs on CUDA."""
    from warmcap.assembly import resolve_device

    return resolve_device(device).type != "cuda"


def serving_graphs(engine: dict[str, Any], startup: StartupOptions) -> tuple[dict[str, Any], StartupOptions]:
    """``warmup serve``'s graphs where the flags leave them open: on CUDA every decode size (the
    start-up options as given); on CPU the graphs that pay, those a ``static`` graph records
    (``graphs/capture/capturer.py:RECORD_MAX_TOKENS``, 32 tokens: past it a replay runs the eager
    forward again): decode graphs at the capture ladder up to that, decode steps padded to it, and
    no mixed graph (``graph_shapes`` ``decode``: a mixed step of 32 tokens or fewer is rare when
    prompts are chunked 2048 tokens a step), so start-up verifies 7 graphs rather than one per
    request count and the mixed ladder (163 for 128 sequences: minutes). Larger batches run eagerly."""
    from dataclasses import replace

    from warmcap.assembly import resolve_device
    from warmcap.config import SpeculativeConfig
    from warmcap.graphs.capture.capturer import RECORD_MAX_TOKENS
    from warmcap.graphs.capture.sizes import default_capture_sizes

    out = dict(engine)
    cuda = resolve_device(engine["device"]).type == "cuda"
    if out.get("enforce_eager") is None:
        out["enforce_eager"] = False
    if cuda or out["enforce_eager"]:
        return out, startup
    if startup.capture_sizes is None:
        spec = SpeculativeConfig.parse(out.get("speculative_config") or "none")
        k = spec.num_speculative_tokens if spec is not None else 0
        ladder = default_capture_sizes(out["max_num_seqs"], k)
        startup = replace(startup, capture_sizes=tuple(s for s in ladder if s <= RECORD_MAX_TOKENS) or (1,))
    if startup.graph_shapes is None:
        startup = replace(startup, graph_shapes="decode")
    return out, startup


def _refuse_unshardable(model: str, tensor_parallel_size: int) -> None:
    """Refuse, as start-up would, a model family that cannot be sharded (read from config.json only)."""
    from pathlib import Path

    from warmcap.models.decoder import check_tensor_parallel
    from warmcap.models.loader import load_hf_config
    from warmcap.models.presets import resolve_model
    from warmcap.models.registry import model_class

    path = Path(model).expanduser()
    if not path.is_dir():
        path = Path(resolve_model(model, config_only=True))
    check_tensor_parallel(model_class(load_hf_config(path).architectures[0]), tensor_parallel_size)


# ---- warmup generate -----------------------------------------------------------------------------


@app.command()
@_user_errors
@engine_options(GENERATE)
@takes_startup_options
def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The prompt text.")],
    model: Model = "smollm2-135m",
    max_tokens: Annotated[int, typer.Option(help="Most new tokens.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0: off).")] = 0,
    seed: Annotated[int | None, typer.Option(help="Per-request sampling seed.")] = None,
    chat: Annotated[
        bool, typer.Option("--chat/--no-chat", help="Wrap the prompt in the model's chat template.")
    ] = True,
    quiet: Quiet = False,
    verbose: Verbose = False,
    startup: StartupOptions = _SD,
    **engine: Any,
) -> None:
    """Generate text, streamed as it comes; with --spec, acceptance stats follow.

    Start-up is sized for this one request (one sequence, a context of prompt + max_tokens, a step
    budget of min(512, context)), so the first token comes soon; raise --max-num-seqs /
    --max-model-len to size it like a server.
    """
    _worker_if_launched(engine["tensor_parallel_size"], quiet=quiet, verbose=verbose)
    from warmcap.audit.kv_writes import AuditViolationError
    from warmcap.config import SpeculativeConfig
    from warmcap.llm import LLM
    from warmcap.models.loader import load_tokenizer
    from warmcap.models.presets import resolve_model_path
    from warmcap.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens
    )
    speculative = SpeculativeConfig.parse(engine["speculative_config"])
    tokenizer = load_tokenizer(resolve_model_path(model))
    use_chat = chat and getattr(tokenizer, "chat_template", None) is not None
    prompt_ids = _prompt_ids(tokenizer, prompt, chat=use_chat)
    if engine["max_model_len"] is None:
        lookahead = speculative.num_speculative_tokens if speculative else 0
        wanted = request_context_len(len(prompt_ids), max_tokens, lookahead, block_size=engine["block_size"])
        engine["max_model_len"] = _within_model_limit(model, wanted)
    if engine["max_num_batched_tokens"] is None:
        context = engine["max_model_len"] if isinstance(engine["max_model_len"], int) else 512
        engine["max_num_batched_tokens"] = max(engine["max_num_seqs"], min(512, context))
    if engine["enforce_eager"] is None:
        engine["enforce_eager"] = serving_enforce_eager(engine["device"])
    with _watched_startup(quiet=quiet, verbose=verbose):
        llm = LLM(model, startup=startup, **{k: v for k, v in engine.items() if v is not None})
    out = Console()
    streamed = False
    try:
        for delta in llm.engine.stream(prompt_ids, params):
            out.print(delta, end="", highlight=False, markup=False, soft_wrap=True)
            streamed = True
    except BaseException as exc:
        if streamed:
            out.print()  # the text so far ends its line: an error that follows gets a line of its own
        if not isinstance(exc, AuditViolationError):
            raise
        # Not the user's input: warmcap wrote KV outside a request's blocks, so exit 1, not 2. A
        # model whose logits turn non-finite is an unusable model given, like any other (exit 2).
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    out.print()
    stats = _spec_stats(llm)
    if stats:
        err.print(stats, highlight=False)


def request_context_len(prompt_len: int, max_tokens: int, lookahead: int, *, block_size: int) -> int:
    """The context one request needs (its prompt, its new tokens, the drafts the last verify step
    may hold), rounded up to whole KV blocks."""
    from warmcap.core.reservation import block_aligned_len

    return block_aligned_len(prompt_len + max_tokens + lookahead, block_size)


def _within_model_limit(model: str, wanted: int) -> int | None:
    """``wanted``, or None (the model's own limit) when the model states a smaller one: the
    engine then refuses an overlong request with its usual message."""
    from warmcap.assembly import model_max_len
    from warmcap.models.loader import load_hf_config
    from warmcap.models.presets import resolve_model_path

    limit = model_max_len(load_hf_config(resolve_model_path(model)))
    return None if limit is not None and wanted > limit else wanted


def _prompt_ids(tokenizer: Any, prompt: str, *, chat: bool) -> list[int]:
    """The prompt's token ids, through the chat template when ``chat`` (as ``LLM.chat`` builds them)."""
    if tokenizer is None:
        raise WarmcapError("the model folder has no tokenizer: `warmup generate` needs one to read --prompt")
    if not chat:
        return list(tokenizer.encode(prompt))
    from warmcap.prompts import chat_prompt_ids

    return chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])


def _spec_stats(llm) -> str | None:
    if llm.engine.config.speculative is None:
        return None
    metrics = llm.engine.spec_metrics
    from warmcap.metrics import format_spec_stats

    return format_spec_stats(metrics)


# ---- warmup run ----------------------------------------------------------------------------------


@app.command()
@_user_errors
@engine_options(STARTUP)
@takes_startup_options
def run(
    model: Model = "smollm2-135m",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report as JSON instead of tables.")
    ] = False,
    out: Annotated[
        str | None, typer.Option("--out", "-o", help="Also write the JSON report to this file.")
    ] = None,
    strict: Annotated[bool, typer.Option(help="Exit non-zero when any graph fails verification.")] = False,
    html: Html = None,
    quiet: Quiet = False,
    verbose: Verbose = False,
    startup: StartupOptions = _SD,
    **engine: Any,
) -> None:
    """Full start-up — load, size KV, audited warmup + scrub, graph capture + verify, smoke run — then the report.

    The default engine is a quick one (draft_model:2 — the model drafts for itself, a method that
    writes draft KV — 4 sequences, 256 tokens a step, a 1024-token context); `warmup plan` takes the
    same options and defaults. Exits 1 on any warmup audit violation (always) or failed graph
    verification (with --strict).
    """
    _worker_if_launched(engine["tensor_parallel_size"], quiet=quiet, verbose=verbose)
    from pathlib import Path

    from warmcap.graphs.proof.render import render
    from warmcap.startup import run_startup
    from warmcap.warmup.hook import VIOLATION_ADVICE

    config = engine_config(model, engine)
    for path, flag in ((out, "--out"), (html, "--html")):
        if path:
            _check_out_path(path, flag)
    console = Console()
    if not as_json:
        spec = config.speculative.short() if config.speculative else "none"
        console.print(
            f"[bold]warmup run[/] {model} spec={spec}: loading, warmup with audit, graph capture ..."
        )
    with _watched_startup(quiet=quiet, verbose=verbose):
        result = run_startup(config, startup)
    report = result.report
    # Tensor parallelism: the worker ranks are not needed for printing the report.
    result.engine.shutdown()
    if out:
        Path(out).write_text(report.to_json())
    if html:
        from warmcap.pages.write import write_report_page

        write_report_page(html, report.to_dict(), result.engine.warmup_result)
    if as_json:
        typer.echo(report.to_json())
    else:
        render(report, console)
        for i, text in enumerate(result.smoke_texts):
            console.print(f"[bold]smoke {i}[/] {text!r}", highlight=False)
    if result.audit_violations:
        samples = report.warmup_audit.violation_samples
        err.print(
            f"[bold red]FAIL:[/] warmup audit found {result.audit_violations} stray KV write(s), first: "
            f"{escape(samples[0]) if samples else '?'}; {VIOLATION_ADVICE}",
            highlight=False,
        )
        raise typer.Exit(1)
    if strict and result.failed_verification:
        err.print("[bold red]FAIL:[/] a captured graph does not replay like eager (--strict)")
        raise typer.Exit(1)


# ---- warmup report -------------------------------------------------------------------------------


@app.command()
@_user_errors
def report(
    file: Annotated[str | None, typer.Argument(help="A JSON report written by `warmup run --out`.")] = None,
    diff: Annotated[
        tuple[str, str] | None, typer.Option("--diff", help="OLD NEW: flag regressions of NEW against OLD.")
    ] = None,
    time_tolerance: Annotated[
        float, typer.Option(help="Relative capture-time growth that counts as a regression.")
    ] = 0.25,
    memory_tolerance: Annotated[
        float, typer.Option(help="Relative memory growth that counts as a regression.")
    ] = 0.10,
    html: Html = None,
) -> None:
    """Render a saved capture report, or compare two (exit 1 on any regression, for CI)."""
    from warmcap.graphs.proof.diff import diff_reports
    from warmcap.graphs.proof.render import render, render_diff
    from warmcap.pages import write as pages

    console = Console()
    if html:
        _check_out_path(html, "--html")
    if diff:
        old_path, new_path = diff
        old, new = _load_report(old_path), _load_report(new_path)
        result = diff_reports(old, new, time_tolerance=time_tolerance, memory_tolerance=memory_tolerance)
        render_diff(result, console)
        if html:
            rows = [{"metric": r.metric, "old": r.old, "new": r.new, "status": r.status} for r in result.rows]
            pages.write_diff_page(html, old.to_dict(), new.to_dict(), rows, (old_path, new_path))
        if result.has_regressions:
            raise typer.Exit(1)
        return
    if not file:
        raise WarmcapError("give a report FILE to render, or --diff OLD NEW")
    loaded = _load_report(file)
    render(loaded, console)
    if html:
        pages.write_report_page(html, loaded.to_dict())


def _check_out_path(path: str, flag: str = "--out") -> None:
    """Refuse an output path that cannot be written, before a run spends minutes on the report."""
    import os
    from pathlib import Path

    p = Path(path)
    example = "report.html" if flag == "--html" else "report.json"
    if p.is_dir():
        raise WarmcapError(f"{flag} {path!r} is a folder: give a file path such as {str(p / example)!r}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise WarmcapError(
            f"{flag} {path!r}: folder {str(parent)!r} does not exist: create it first (mkdir -p)"
        )
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise WarmcapError(f"{flag} {path!r} is not writable: choose another path or fix its permissions")


def _load_report(path: str):
    from pathlib import Path

    from warmcap.graphs.proof.report import CaptureReport

    p = Path(path)
    if not p.is_file():
        raise WarmcapError(f"report file {path!r} does not exist: write one with `warmup run --out FILE`")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise WarmcapError(
            f"report file {path!r} is not text (binary data): give a JSON report written by `warmup run --out`"
        ) from None
    except OSError as exc:
        raise WarmcapError(
            f"report file {path!r} cannot be read ({exc.strerror}): check its permissions"
        ) from None
    try:
        return CaptureReport.from_json(text)
    except WarmcapError as exc:
        raise WarmcapError(f"report file {path!r}: {exc}") from None


# ---- warmup serve --------------------------------------------------------------------------------


@app.command()
@_user_errors
@engine_options(SERVE)
@takes_startup_options
def serve(
    model: Model = "smollm2-135m",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="WARMCAP_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/* requests."),
    ] = None,
    poison_free_kv: Annotated[
        bool,
        typer.Option(
            "--poison-free-kv",
            help="Debug: fill every free KV block with a large poison value before the first request "
            "(a visible read of KV never written changes the output).",
        ),
    ] = False,
    model_threads: Annotated[
        int | None,
        typer.Option(
            "--model-threads",
            help="CPU threads for the model (torch intra-op). Default: one per core this process may use.",
        ),
    ] = None,
    quiet: Quiet = False,
    verbose: Verbose = False,
    startup: StartupOptions = _SD,
    **engine: Any,
) -> None:
    """OpenAI-compatible server (completions, chat, /metrics), ready only once start-up is audited clean.

    Sized for serving by default, as vLLM's OpenAI server: the model's context, and on CPU 128
    sequences, 2048 tokens a step (at most 512 of them prompt tokens while requests decode:
    --max-prefill-tokens-with-decodes) and a 4 GiB KV space (--kv-cache-space; on CUDA 256 or 1024
    sequences by device memory and --gpu-memory-utilization). `warmup plan --serve` prints its warmup.
    Exits 2 when the model or options given are unusable (as every command does), 1 when start-up
    finds a stray KV write, graphs that do not replay like eager, or fails otherwise; 0 after
    SIGINT/SIGTERM.
    """
    _worker_if_launched(engine["tensor_parallel_size"], quiet=quiet, verbose=verbose)
    from warmcap.serve.app import ServeOptions
    from warmcap.serve.server import serve as run_server

    engine, startup = serving_graphs(serving_engine_values(engine), startup)
    config = engine_config(model, engine)
    options = ServeOptions(api_key=api_key, startup=startup, poison_free_kv=poison_free_kv)
    # A server logs its start-up phases (INFO; every step with --verbose) instead of drawing them:
    # its stderr is a log, and start-up runs in the app's own thread.
    from logging import INFO

    from warmcap.progress import configure_logging, log_level

    _one_of(quiet=quiet, verbose=verbose)
    configure_logging(err, log_level(quiet=quiet, verbose=verbose, default=INFO), name="warmcap.startup")
    failure = run_server(config, options, host=host, port=port, model_threads=model_threads)
    if failure is not None:
        err.print(
            f"[bold red]FAIL:[/] start-up did not become ready: {escape(failure.reason)}", highlight=False
        )
        raise typer.Exit(EXIT_USAGE if failure.bad_input else 1)


# ---- warmup worker -------------------------------------------------------------------------------


@app.command()
@_user_errors
def worker(
    timeout: float = typer.Option(
        None,
        help="Seconds to wait for rank 0 to open the group, and for any one collective "
        "(default: the group's collective timeout, 60).",
    ),
    quiet: Quiet = False,
    verbose: Verbose = False,
) -> None:
    """Serve as tensor-parallel rank RANK > 0 of an engine whose ranks a launcher started.

    Reads the torch.distributed environment (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK; LOCAL_RANK
    picks the GPU). Rank 0 runs the engine's command with -tp WORLD_SIZE and sends this rank its
    config, so no model flags are needed. Exits 0 when rank 0 shuts the engine down, 1 on failure.
    """
    raise typer.Exit(_run_worker(quiet=quiet, verbose=verbose, timeout_s=timeout))


# ---- warmup accept -------------------------------------------------------------------------------


@app.command()
@_user_errors
def accept(
    spec: Spec,
    model: Model = "smollm2-135m",
    url: str = typer.Option(
        None, help="Measure the OpenAI server (or P/D proxy) at this URL instead of an in-process engine."
    ),
    metrics_url: str = typer.Option(
        None, help="Where the spec-decode counters are scraped (default: --url); a proxy's decode server."
    ),
    api_key: str = typer.Option(None, envvar="WARMCAP_API_KEY", help="Bearer key of the server at --url."),
    baseline: str = typer.Option(
        None, help="Baseline JSON (default: the one shipped for --model and --spec, if any)."
    ),
    rtol: float = typer.Option(0.05, help="Relative drop of any checked number that counts as a regression."),
    write_baseline: bool = typer.Option(
        False,
        "--write-baseline",
        help="Record this run as the baseline (to --baseline) instead of comparing.",
    ),
    max_tokens: int = typer.Option(None, help="New tokens per prompt (default: the baseline's, else 24)."),
    prompts: str = typer.Option(None, help="A JSONL prompt set (default: the shipped one)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    quiet: Quiet = False,
    verbose: Verbose = False,
) -> None:
    """Measure speculative acceptance on a fixed prompt set and compare it with a stored baseline.

    Reads vLLM's spec-decode counters (in-process, or from the server's /metrics). Exits 1 when the
    acceptance length or any position's acceptance rate fell by more than --rtol, 2 on a missing,
    invalid or mismatched baseline.
    """
    import json
    from pathlib import Path

    from warmcap.accept import baseline as ab
    from warmcap.accept import harness as acc
    from warmcap.accept.view import accept_json, render_comparison, render_measurement

    speculative = acc.parse_spec(spec)
    prompt_set = acc.load_prompt_set(Path(prompts) if prompts else None)
    baseline_path = Path(baseline) if baseline else ab.default_baseline_path(model, speculative)
    stored = None
    if write_baseline:
        ab.check_baseline_target(baseline_path)
    else:
        ab.check_rtol(rtol)
        stored = ab.load_baseline(baseline_path)
        if max_tokens is None:
            max_tokens = stored.max_tokens
        ab.check_baseline_matches(
            stored, baseline_path, model=model, spec=speculative, prompt_set=prompt_set, max_tokens=max_tokens
        )
    if max_tokens is None:
        max_tokens = acc.DEFAULT_MAX_TOKENS
    if url:
        measurement = acc.measure_server(
            url, model, speculative, prompt_set, max_tokens, metrics_url=metrics_url, api_key=api_key
        )
    else:
        with _watched_startup(quiet=quiet or as_json, verbose=verbose):
            measurement = acc.measure_in_process(model, speculative, prompt_set, max_tokens)
    console = Console()
    comparison = None
    if write_baseline:
        record = ab.Baseline(
            model=model,
            spec=ab.spec_identity(speculative),
            prompt_set_sha256=prompt_set.sha256,
            max_tokens=max_tokens,
            acceptance=measurement.acceptance,
            notes={"source": measurement.source, "completion_tokens": measurement.completion_tokens},
        )
        ab.write_baseline(record, baseline_path)
    if stored is not None:
        comparison = ab.compare(stored.acceptance, measurement.acceptance, rtol)
    if as_json:
        doc = accept_json(
            model=model,
            spec=ab.spec_identity(speculative),
            prompt_set=prompt_set,
            max_tokens=max_tokens,
            measurement=measurement,
            baseline_path=baseline_path,
            comparison=comparison,
        )
        typer.echo(json.dumps(doc, indent=1))
    else:
        render_measurement(measurement, console)
        if comparison is None:
            console.print(f"baseline written to {baseline_path}", highlight=False, soft_wrap=True)
        else:
            render_comparison(comparison, baseline_path, console)
    if comparison is not None and not comparison.passed:
        raise typer.Exit(1)


# ---- warmup proxy --------------------------------------------------------------------------------


@app.command()
@_user_errors
def proxy(
    prefill: str = typer.Option(
        ..., "--prefill", help="Base URL of the prefill server (kv_producer), e.g. http://127.0.0.1:8100."
    ),
    decode: str = typer.Option(
        ..., "--decode", help="Base URL of the decode server (kv_consumer), e.g. http://127.0.0.1:8200."
    ),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
) -> None:
    """P/D proxy: each request prefills on --prefill (one token), then decodes on --decode with the KV read from it."""
    from warmcap.serve.proxy import run_proxy

    for name, url in (("--prefill", prefill), ("--decode", decode)):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{name} {url!r} is not a URL: give http://HOST:PORT of a warmup serve")
    run_proxy(prefill, decode, host=host, port=port)
