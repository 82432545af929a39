"""The ``warmup`` commands' shared options: one ``Annotated`` type per option, so every command
spells, documents and defaults it the same way.

Engine options come from the table in ``engine_args.py`` (their help text included): a command
declares a parameter named after the table entry with the type below, and ``cli.engine_config``
hands every such parameter to ``engine_args.build_config``.

Defaults. ``warmup plan`` and ``warmup run`` describe one engine, so they share :data:`STARTUP`
(a small start-up that finishes in seconds on a CPU, with a drafter that writes KV so the audit
has draft passes to check); ``warmup plan`` with a run's flags prints the plan that run executes.
``warmup serve`` sizes for serving (:data:`SERVE`: the model's context, and the sequences and step
budget vLLM's OpenAI server takes on the device, ``engine_args.serving_batch_defaults``: 128 and
2048 on CPU). ``warmup generate`` sizes for its one request (its help says how).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import wraps
from typing import Annotated, Any

import typer

from warmcap.config import StartupOptions
from warmcap.engine_args import ARGS_BY_NAME, ENGINE_ARGS, EngineArg
from warmcap.errors import ConfigError


@dataclass(frozen=True, slots=True)
class CommandDefaults:
    """The sizing defaults of a group of commands, and what their help says of a default computed
    by the command itself."""

    speculative_config: str
    #: None: computed by the command (``generate``: from the prompt; ``serve``: for the device)
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    max_model_len: int | None
    #: None: the command decides (eager on CPU, graphs on CUDA)
    enforce_eager: bool | None
    #: appended to an engine option's help, by option name
    help_notes: Mapping[str, str] = field(default_factory=dict)


_EAGER_BY_DEVICE = (
    " Default: eager on CPU, where the static graph backend replays eager code; graphs on CUDA."
)

#: ``warmup plan`` and ``warmup run``: the engine a quick start-up builds (documented in README)
STARTUP = CommandDefaults(
    speculative_config="draft_model:2",
    max_num_seqs=4,
    max_num_batched_tokens=256,
    max_model_len=1024,
    enforce_eager=False,
)
#: ``warmup generate``: sized for its one request (a None here is computed from the prompt)
GENERATE = CommandDefaults(
    speculative_config="none",
    max_num_seqs=1,
    max_num_batched_tokens=None,
    max_model_len=None,
    enforce_eager=None,
    help_notes={
        "max_model_len": " Default: prompt + max_tokens, rounded up to a block (the model's own if larger).",
        "max_num_batched_tokens": " Default: min(512, the context).",
        "enforce_eager": _EAGER_BY_DEVICE,
    },
)
#: ``warmup serve``: sized for serving (the batch limits: vLLM's server defaults for the device)
SERVE = CommandDefaults(
    speculative_config="none",
    max_num_seqs=None,
    max_num_batched_tokens=None,
    max_model_len=None,
    enforce_eager=None,
    help_notes={
        "max_num_seqs": " Default: vLLM's server default for the device (128 on CPU).",
        "max_num_batched_tokens": " Default: vLLM's server default for the device (2048 on CPU).",
        "max_prefill_tokens_with_decodes": " Default: 512 on CPU (with chunked prefill), none on CUDA.",
        "enforce_eager": " Default: graphs; on CPU only those a static graph records (up to 32 tokens: "
        "decode graphs at the capture ladder 1, 2, 4, 8, 16, 24, 32, decode steps padded to it: "
        "--graph-shapes decode), larger and mixed batches eager.",
    },
)


MODEL_HELP = "Preset name (smollm2-135m, tiny-llama, tiny-qwen3, ...) or a local HF directory."

Model = Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)]


def _parser(arg: EngineArg) -> Callable[[str], Any] | None:
    """The table's parser with its ConfigError as click's own refusal (one line, exit 2)."""
    parse = arg.parse
    if parse is None:
        return None

    def parser(value: Any) -> Any:
        if value is None or not isinstance(value, str):
            return value
        try:
            return parse(value)
        except ConfigError as exc:
            raise typer.BadParameter(str(exc)) from None

    return parser


def engine_option_type(arg: EngineArg, defaults: CommandDefaults | None = None) -> Any:
    """The ``Annotated`` command-line type of the engine option ``arg``, built from its table entry
    (and a command's note on its default)."""
    note = defaults.help_notes.get(arg.name, "") if defaults is not None else ""
    option: dict[str, Any] = {"help": arg.help + note}
    if arg.metavar:
        option["metavar"] = arg.metavar
    parser = _parser(arg)
    if parser is not None:
        option["parser"] = parser
    return Annotated[arg.cli_type, typer.Option(*arg.flags, **option)]


#: ``--spec``, for a command that takes it without the other engine options (``warmup accept``)
Spec = engine_option_type(ARGS_BY_NAME["speculative_config"])

# ---- start-up options (warmup run, serve, generate): config.StartupOptions, its defaults ------------
#: the one set of start-up defaults every command shows (``LLM`` and ``run_startup`` use the same)
STARTUP_DEFAULTS = StartupOptions()
Backend = Annotated[
    str | None,
    typer.Option(help="Graph backend: cuda, static or compile (default: cuda on a GPU, else static)."),
]
CaptureSizes = Annotated[
    str | None, typer.Option(help="Comma-separated token counts to capture, e.g. 1,2,4,8.")
]
Audit = Annotated[
    bool,
    typer.Option(
        "--audit/--no-audit",
        help="Audit every KV write warmup makes (default: on, on every device); --no-audit skips it and "
        "the report says 'audit off'.",
    ),
]
AuditServing = Annotated[
    bool,
    typer.Option(
        "--audit-serving",
        help="Audit the KV writes of every serving step, as warmup is audited; a step that writes outside "
        "its blocks fails with the request, group, position and slot (slower: a debugging and CI switch).",
    ),
]
StartupCache = Annotated[
    bool,
    typer.Option(
        "--startup-cache/--no-startup-cache",
        help="Reuse graph verdicts of an identical earlier start (one graph per phase is still "
        "verified); the cache is $WARMCAP_STARTUP_CACHE or startup/ in the warmcap cache.",
    ),
]


RecordCpuGraphs = Annotated[
    bool,
    typer.Option(
        "--record-cpu-graphs/--no-record-cpu-graphs",
        help="On CPU, static graphs of up to 32 tokens replay a recording of their forward's kernel calls "
        "(default: on; each is still verified against eager); --no-record-cpu-graphs runs the forward "
        "at every replay.",
    ),
]


GraphShapes = Annotated[
    str | None,
    typer.Option(
        help="Which graphs: all (a decode graph per request count up to --max-num-seqs, no decode step "
        "padded; mixed graphs at the capture sizes), sizes (both at the capture sizes only, a decode "
        "step padded to the next, as vLLM pads) or decode (decode graphs at the capture sizes, mixed "
        "steps eager). Default: all; warmup serve on CPU: decode.",
    ),
]


def startup_options(
    *,
    backend: str | None,
    capture_sizes: str | None,
    audit: bool = STARTUP_DEFAULTS.audit,
    audit_serving: bool = STARTUP_DEFAULTS.audit_serving,
    startup_cache: bool = STARTUP_DEFAULTS.startup_cache,
    record_cpu_graphs: bool = STARTUP_DEFAULTS.record_cpu_graphs,
    graph_shapes: str | None = None,
) -> StartupOptions:
    """The command's start-up options as one record (``--capture-sizes`` parsed)."""
    from warmcap.graphs.capture.sizes import parse_capture_sizes

    sizes = tuple(parse_capture_sizes(capture_sizes)) if capture_sizes else None
    return StartupOptions(
        backend=backend,
        capture_sizes=sizes,
        audit=audit,
        audit_serving=audit_serving,
        startup_cache=startup_cache,
        record_cpu_graphs=record_cpu_graphs,
        graph_shapes=graph_shapes,
    )


#: the command-line type of each start-up option (``StartupOptions``' fields), declared once
STARTUP_OPTION_TYPES: dict[str, Any] = {
    "backend": Backend,
    "capture_sizes": CaptureSizes,
    "audit": Audit,
    "audit_serving": AuditServing,
    "startup_cache": StartupCache,
    "record_cpu_graphs": RecordCpuGraphs,
    "graph_shapes": GraphShapes,
}


def takes_startup_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give a command every start-up option as a flag, with ``StartupOptions``' defaults, and hand
    them to it as one record: its keyword-only ``startup`` parameter."""
    sig = inspect.signature(fn, eval_str=True)
    params = [p for p in sig.parameters.values() if p.name != "startup"]
    rest = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    var_kw = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    added = [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            annotation=annotation,
            # --capture-sizes is text; unset (None) --capture-sizes and --graph-shapes leave the
            # choice to the command (warmup serve on CPU picks its own)
            default=None if name in ("capture_sizes", "graph_shapes") else getattr(STARTUP_DEFAULTS, name),
        )
        for name, annotation in STARTUP_OPTION_TYPES.items()
    ]

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        values = {name: kwargs.pop(name) for name in STARTUP_OPTION_TYPES}
        return fn(*args, startup=startup_options(**values), **kwargs)

    wrapper.__signature__ = sig.replace(parameters=rest + added + var_kw)  # type: ignore[attr-defined]
    return wrapper


Html = Annotated[
    str | None,
    typer.Option(
        "--html",
        help="Also write a self-contained HTML page to this file: the plan's block layouts (plan), "
        "the report with the warmup steps' block grids and audited writes (run, report), or the diff "
        "side by side (report --diff).",
    ),
]
Quiet = Annotated[
    bool, typer.Option("--quiet", "-q", help="No start-up progress and only errors from the log (stderr).")
]
Verbose = Annotated[
    bool,
    typer.Option(
        "--verbose", "-v", help="Log each start-up phase (INFO, stderr) besides the progress display."
    ),
]


def option_default(name: str, defaults: CommandDefaults) -> Any:
    """A command's default for the engine option ``name``: its group's sizing default, else the
    config's own (so the command line and ``LLM()`` start from the same values). Read from the
    config classes' field defaults, never by building a config: a bad environment variable is
    refused when the command runs (one line, exit 2), not when the CLI is imported."""
    from dataclasses import MISSING, fields

    from warmcap.config import EngineConfig
    from warmcap.engine_args import CONFIG_PARTS

    if hasattr(defaults, name):
        return getattr(defaults, name)
    arg = ARGS_BY_NAME[name]
    if arg.part == "kernel":
        return None  # unset: the config's default, its environment variable (warmcap/env.py)
    if arg.part is None:
        special = {"kv_transfer": None, "speculative": "none"}
        if arg.attr in special:
            return special[arg.attr]
        cls = EngineConfig
    else:
        cls = CONFIG_PARTS[arg.part]
    (field_,) = [f for f in fields(cls) if f.name == arg.attr]
    return field_.default_factory() if field_.default is MISSING else field_.default  # type: ignore[misc]


def engine_options(defaults: CommandDefaults) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command every engine option of the table that it does not declare itself.

    The command takes them as ``**engine`` keyword arguments; ``cli.engine_config`` turns its own
    engine parameters and those into one :class:`EngineConfig`.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        names = {p.name for p in own}
        added = [
            inspect.Parameter(
                arg.name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=engine_option_type(arg, defaults),
                default=option_default(arg.name, defaults),
            )
            for arg in ENGINE_ARGS
            if arg.cli and arg.name not in names
        ]

        @wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        wrapper.__signature__ = sig.replace(parameters=own + added)  # type: ignore[attr-defined]
        return wrapper

    return decorate
