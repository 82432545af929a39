"""``warmup accept``: speculative acceptance on a fixed prompt set, compared with a stored baseline.

Acceptance is read the way an operator reads it in production: from the spec-decode counters
under vLLM's names, as Prometheus text. An in-process engine renders its counters with
:meth:`SpecDecodeMetrics.to_prometheus`; a server (or a P/D proxy in front of one) serves them at
``/metrics``. Both go through :func:`read_acceptance`, so the three paths cannot disagree on what
the numbers mean. A run is the difference of the counters after and before the prompt set.

Prompts go one at a time, greedy, in every path. NOTE: batch composition can move float sums and
so a greedy tie; one request at a time makes in-process, server and proxy runs agree exactly.

The prompt set ships in ``warmup/data`` and the baselines in ``warmup/baselines``; a baseline
pins the model, the speculative setting, the prompt set (by hash) and ``max_tokens``, since
acceptance of one workload says nothing about another.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client.parser import text_string_to_metric_families

from warmcap import __version__
from warmcap.errors import WarmcapError

if TYPE_CHECKING:
    from warmcap.config import SpeculativeConfig

PROMPT_SET = "accept_prompts.jsonl"
DEFAULT_MAX_TOKENS = 24
DEFAULT_RTOL = 0.05
IN_PROCESS_MAX_MODEL_LEN = 512
BASELINE_FORMAT = 1

_PREFIX = "vllm:spec_decode_"
_DRAFTS = _PREFIX + "num_drafts_total"
_DRAFT_TOKENS = _PREFIX + "num_draft_tokens_total"
_ACCEPTED = _PREFIX + "num_accepted_tokens_total"
_PER_POS = _PREFIX + "num_accepted_tokens_per_pos_total"

Kind = Literal["chat", "completion"]
Status = Literal["PASS", "FAIL", "HIGH"]


# ---- the prompt set ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AcceptPrompt:
    """One prompt: ``chat`` goes through the model's chat template, ``completion`` is raw text."""

    id: str
    kind: Kind
    text: str


@dataclass(frozen=True, slots=True)
class PromptSet:
    prompts: tuple[AcceptPrompt, ...]
    #: sha256 of the prompts as canonical JSON: a baseline is valid only for the set it measured
    sha256: str


def default_prompt_set_path() -> Path:
    return Path(str(resources.files("warmcap.warmup") / "data" / PROMPT_SET))


def load_prompt_set(path: Path | None = None) -> PromptSet:
    """The prompts of a JSONL file (``{"id", "kind": "chat"|"completion", "prompt"}`` per line);
    the shipped set by default."""
    path = path or default_prompt_set_path()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise WarmcapError(f"prompt set {str(path)!r} cannot be read ({exc.strerror})") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = AcceptPrompt(id=str(row["id"]), kind=row["kind"], text=row["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise WarmcapError(
                f"prompt set {str(path)!r} line {n} is not a JSON object with id, kind and prompt"
            ) from None
        if prompt.kind not in ("chat", "completion") or not isinstance(prompt.text, str):
            raise WarmcapError(
                f"prompt set {str(path)!r} line {n}: kind must be 'chat' or 'completion' and prompt "
                f"a string; got kind {prompt.kind!r}"
            )
        prompts.append(prompt)
    if not prompts:
        raise WarmcapError(f"prompt set {str(path)!r} has no prompts")
    canonical = json.dumps([asdict(p) for p in prompts], sort_keys=True, ensure_ascii=True)
    return PromptSet(tuple(prompts), hashlib.sha256(canonical.encode()).hexdigest())


# ---- acceptance from the counters ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Acceptance:
    """Spec-decode counter values (or the difference of two readings).

    ``accepted_per_pos[i]`` counts drafts whose first ``i + 1`` tokens were all accepted, so the
    per-position rates never increase with the position.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    @property
    def acceptance_length(self) -> float:
        """Mean tokens a verify step yields: 1 + accepted / drafts (1.0 without drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_rates(self) -> tuple[float, ...]:
        """Fraction of drafts accepted up to and including each position."""
        if not self.num_drafts:
            return tuple(0.0 for _ in self.accepted_per_pos)
        return tuple(c / self.num_drafts for c in self.accepted_per_pos)

    def padded(self, num_positions: int) -> Acceptance:
        """The same counts with the per-position series extended by zeros to ``num_positions``."""
        extra = num_positions - len(self.accepted_per_pos)
        return replace(self, accepted_per_pos=self.accepted_per_pos + (0,) * max(extra, 0))

    def since(self, before: Acceptance) -> Acceptance:
        """What was counted after ``before`` was read (counters only grow)."""
        n = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        now, then = self.padded(n), before.padded(n)
        return Acceptance(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            tuple(a - b for a, b in zip(now.accepted_per_pos, then.accepted_per_pos, strict=True)),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_length": self.acceptance_length,
            "per_position_rates": list(self.per_position_rates),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Acceptance:
        counts = (data["num_drafts"], data["num_draft_tokens"], data["num_accepted_tokens"])
        per_pos = tuple(data["accepted_per_pos"])
        if not all(isinstance(v, int) and v >= 0 for v in (*counts, *per_pos)):
            raise ValueError("counts must be non-negative integers")
        if any(a < b for a, b in itertools.pairwise((counts[0], *per_pos))):
            raise ValueError(
                f"accepted_per_pos {list(per_pos)} rises with the position or exceeds num_drafts "
                f"{counts[0]}: a draft accepted at position i + 1 was accepted at i"
            )
        if sum(per_pos) != counts[2]:
            raise ValueError(
                f"accepted_per_pos sums to {sum(per_pos)} but num_accepted_tokens is {counts[2]}"
            )
        acceptance = cls(*counts, per_pos)
        # NOTE: the rates are written for readers and derived from the counts on load; a hand edit
        # of a rate alone would otherwise be ignored silently.
        derived = [acceptance.acceptance_length, *acceptance.per_position_rates]
        written = [data.get("acceptance_length", derived[0]), *data.get("per_position_rates", derived[1:])]
        if len(written) != len(derived) or not all(
            math.isclose(w, d, rel_tol=1e-9) for w, d in zip(written, derived, strict=True)
        ):
            raise ValueError(
                "acceptance_length or per_position_rates disagree with the counts: edit the counts"
            )
        return acceptance


def read_acceptance(text: str, *, model_name: str | None = None) -> Acceptance:
    """The four spec-decode counters of a Prometheus text exposition.

    Samples labelled with another ``model_name`` are ignored (a scrape may cover several models).
    Raises :class:`WarmcapError` when the text has no spec-decode counters at all.
    """
    totals = {_DRAFTS: 0, _DRAFT_TOKENS: 0, _ACCEPTED: 0}
    per_pos: dict[int, int] = {}
    seen = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if model_name is not None and labels.get("model_name", model_name) != model_name:
                continue
            if sample.name in totals:
                totals[sample.name] += int(sample.value)
                seen = True
            elif sample.name == _PER_POS:
                pos = int(labels["position"])
                per_pos[pos] = per_pos.get(pos, 0) + int(sample.value)
    if not seen:
        who = f" for model {model_name!r}" if model_name else ""
        raise WarmcapError(
            f"no {_DRAFTS} counter{who} in the metrics: the endpoint is not a warmcap or vLLM server "
            "with speculative decoding, or it serves another model"
        )
    ordered = tuple(per_pos.get(i, 0) for i in range(max(per_pos, default=-1) + 1))
    return Acceptance(totals[_DRAFTS], totals[_DRAFT_TOKENS], totals[_ACCEPTED], ordered)


# ---- measuring -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Measurement:
    """One pass of the prompt set: the counters it moved and the tokens it generated."""

    source: str
    acceptance: Acceptance
    completion_tokens: int


def spec_identity(spec: SpeculativeConfig) -> dict[str, Any]:
    """The fields of a speculative setting that change what is drafted (ngram's lookup window only
    for ngram)."""
    ident: dict[str, Any] = {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "model": spec.model,
    }
    if spec.method == "ngram":
        ident |= {"prompt_lookup_min": spec.prompt_lookup_min, "prompt_lookup_max": spec.prompt_lookup_max}
    return ident


def parse_spec(text: str) -> SpeculativeConfig:
    from warmcap.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(text)
    if spec is None:
        raise WarmcapError(f"--spec {text!r} turns speculation off: acceptance needs a method, e.g. ngram:3")
    return spec


def measure_in_process(
    model: str,
    spec: SpeculativeConfig,
    prompt_set: PromptSet,
    max_tokens: int,
    *,
    engine_kwargs: dict[str, Any] | None = None,
) -> Measurement:
    """Run the prompt set through an ``LLM`` built here, one prompt at a time, greedy."""
    from warmcap.llm import LLM
    from warmcap.sampling_params import SamplingParams

    # One request at a time needs blocks for one context (twice: a draft model has its own groups);
    # left unset, the pool would be sized from free memory, gigabytes on a CPU host.
    blocks = 2 * -(-IN_PROCESS_MAX_MODEL_LEN // 16) + 2
    kwargs = {
        "max_model_len": IN_PROCESS_MAX_MODEL_LEN,
        "num_blocks": blocks,
        "max_num_seqs": 1,
        "enforce_eager": True,
        **(engine_kwargs or {}),
    }
    llm = LLM(model, speculative_config=asdict(spec), **kwargs)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    def one(prompt: AcceptPrompt) -> int:
        if prompt.kind == "chat":
            out = llm.chat([{"role": "user", "content": prompt.text}], params)
        else:
            out = llm.generate([prompt.text], params)[0]
        return len(out.outputs[0].token_ids)

    return _measure(
        f"in-process ({model})",
        lambda: read_acceptance(engine.spec_metrics.to_prometheus()),
        map(one, prompt_set.prompts),
        spec.num_speculative_tokens,
    )


def measure_server(
    url: str,
    model: str,
    spec: SpeculativeConfig,
    prompt_set: PromptSet,
    max_tokens: int,
    *,
    metrics_url: str | None = None,
    api_key: str | None = None,
    timeout: float = 600.0,
) -> Measurement:
    """Send the prompt set to the OpenAI server at ``url`` (one request at a time, greedy) and read
    the counters from ``metrics_url`` (default: ``url``'s ``/metrics``; a P/D proxy passes the
    decode server's, where drafting happens)."""
    import httpx

    try:
        import openai
    except ImportError:
        raise WarmcapError(
            "--url needs the openai client, which warmcap installs only with its test extra: "
            "pip install 'openai==3.51.0'"
        ) from None

    base = url.rstrip("/")
    scrape_url = (metrics_url or base).rstrip("/")
    scrape_url = scrape_url if scrape_url.endswith("/metrics") else scrape_url + "/metrics"
    client = openai.OpenAI(base_url=base + "/v1", api_key=api_key or "unused", max_retries=0, timeout=timeout)

    def scrape() -> Acceptance:
        try:
            response = httpx.get(scrape_url, timeout=30)
        except httpx.HTTPError as exc:
            raise WarmcapError(f"cannot read {scrape_url} ({exc}): is the server up?") from None
        if response.status_code != 200:
            raise WarmcapError(f"GET {scrape_url} answered {response.status_code}: give --metrics-url")
        reading = read_acceptance(response.text, model_name=model)
        _check_positions(reading, spec, scrape_url)
        return reading

    def one(prompt: AcceptPrompt) -> int:
        try:
            if prompt.kind == "chat":
                chat = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompt.text}],
                    max_tokens=max_tokens,
                    temperature=0.0,
                )
                usage = chat.usage
            else:
                completion = client.completions.create(
                    model=model, prompt=prompt.text, max_tokens=max_tokens, temperature=0.0
                )
                usage = completion.usage
        except openai.APIStatusError as exc:
            raise WarmcapError(
                f"{url} refused prompt {prompt.id!r}: {exc.status_code} {exc.message}"
            ) from None
        except openai.APIConnectionError as exc:
            raise WarmcapError(f"cannot reach {url} ({exc}): is the server up?") from None
        return usage.completion_tokens if usage else 0

    _check_server_spec(base, spec)
    return _measure(base, scrape, map(one, prompt_set.prompts), spec.num_speculative_tokens)


def _measure(
    source: str, read: Callable[[], Acceptance], requests: Iterable[int], num_positions: int
) -> Measurement:
    before = read()
    # ``requests`` is lazy: the prompts run here, between the two readings.
    tokens = sum(requests)
    return Measurement(source, read().since(before).padded(num_positions), tokens)


def _check_positions(reading: Acceptance, spec: SpeculativeConfig, where: str) -> None:
    # NOTE: a server exposes one per-position series per draft token from start-up, so the series
    # count is the k it drafts; more series than --spec's k means another setting is being measured.
    if len(reading.accepted_per_pos) > spec.num_speculative_tokens:
        raise WarmcapError(
            f"{where} counts acceptance at {len(reading.accepted_per_pos)} draft positions but --spec "
            f"{spec.short()} drafts {spec.num_speculative_tokens}: measure the server with its own --spec"
        )


def _check_server_spec(base: str, spec: SpeculativeConfig) -> None:
    """Refuse a warmcap server started with another method (``/startup`` names it); servers
    without that endpoint (vLLM, a proxy) are taken at their word."""
    import httpx

    try:
        response = httpx.get(base + "/startup", timeout=30)
        served = response.json().get("spec", {}) if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError, AttributeError):
        return
    method, k = served.get("method"), served.get("num_speculative_tokens")
    if method is None and k is None:
        return
    if (method, k) != (spec.method, spec.num_speculative_tokens):
        raise WarmcapError(
            f"the server at {base} drafts with {method}:{k} but --spec is {spec.short()}: pass the "
            "server's own setting, or start it with --spec " + spec.short()
        )


# ---- baselines -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Baseline:
    """The acceptance one setting reached on one prompt set, kept in the repository."""

    model: str
    spec: dict[str, Any]
    prompt_set_sha256: str
    max_tokens: int
    acceptance: Acceptance
    warmcap_version: str = __version__
    #: how it was measured (informational: CPU greedy runs are deterministic)
    notes: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        data = {
            "format": BASELINE_FORMAT,
            "model": self.model,
            "spec": self.spec,
            "prompt_set_sha256": self.prompt_set_sha256,
            "max_tokens": self.max_tokens,
            "warmcap_version": self.warmcap_version,
            "notes": self.notes,
            "acceptance": self.acceptance.to_json(),
        }
        return json.dumps(data, indent=1) + "\n"


def check_baseline_target(path: Path) -> None:
    """Refuse a baseline path that cannot be written, before a run spends minutes measuring."""
    if path.is_dir() or not path.parent.is_dir():
        raise WarmcapError(f"cannot write baseline {str(path)!r}: give a file path in an existing folder")


def write_baseline(baseline: Baseline, path: Path) -> None:
    try:
        path.write_text(baseline.to_json(), encoding="utf-8")
    except OSError as exc:
        raise WarmcapError(
            f"cannot write baseline {str(path)!r} ({exc.strerror}): check that its folder exists and is writable"
        ) from None


def default_baseline_path(model: str, spec: SpeculativeConfig) -> Path:
    """Where the shipped baseline for ``model`` and ``spec`` lives (whether or not it exists)."""
    name = f"{Path(model).name}_{spec.method}-{spec.num_speculative_tokens}.json"
    return Path(str(resources.files("warmcap.warmup") / "baselines" / name))


def shipped_baselines() -> list[str]:
    folder = resources.files("warmcap.warmup") / "baselines"
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".json"))


def load_baseline(path: Path) -> Baseline:
    """Read a baseline file; any defect is a :class:`WarmcapError` naming the file."""
    hint = "write one with `warmup accept --write-baseline --baseline PATH`"
    if not path.is_file():
        shipped = ", ".join(shipped_baselines()) or "none"
        raise WarmcapError(f"baseline {str(path)!r} does not exist (shipped: {shipped}): {hint}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != BASELINE_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {BASELINE_FORMAT}")
        return Baseline(
            model=str(data["model"]),
            spec=dict(data["spec"]),
            prompt_set_sha256=str(data["prompt_set_sha256"]),
            max_tokens=int(data["max_tokens"]),
            acceptance=Acceptance.from_json(data["acceptance"]),
            warmcap_version=str(data["warmcap_version"]),
            notes=dict(data.get("notes", {})),
        )
    except (
        OSError,
        UnicodeDecodeError,
        json.JSONDecodeError,
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
    ) as exc:
        raise WarmcapError(f"baseline {str(path)!r} is not a valid baseline ({exc}): {hint}") from None


def check_baseline_matches(
    baseline: Baseline,
    path: Path,
    *,
    model: str,
    spec: SpeculativeConfig,
    prompt_set: PromptSet,
    max_tokens: int,
) -> None:
    """Refuse to compare a run with a baseline of another model, setting or workload."""
    wanted = spec_identity(spec)
    mismatches = []
    if baseline.model != model:
        mismatches.append(f"model {baseline.model!r} (this run: {model!r})")
    if baseline.spec != wanted:
        mismatches.append(f"spec {_spec_text(baseline.spec)} (this run: {_spec_text(wanted)})")
    if baseline.prompt_set_sha256 != prompt_set.sha256:
        mismatches.append(
            f"prompt set {baseline.prompt_set_sha256[:12]} (this run: {prompt_set.sha256[:12]})"
        )
    if baseline.max_tokens != max_tokens:
        mismatches.append(f"max_tokens {baseline.max_tokens} (this run: {max_tokens})")
    if mismatches:
        raise WarmcapError(
            f"baseline {str(path)!r} was measured for another run: "
            + "; ".join(mismatches)
            + ": pass the matching --baseline, or record one with --write-baseline"
        )


def _spec_text(ident: dict[str, Any]) -> str:
    text = f"{ident.get('method')}:{ident.get('num_speculative_tokens')}"
    return text + (f"@{ident['model']}" if ident.get("model") else "")


# ---- comparison ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Check:
    """One compared number: the acceptance length (``position`` None) or one position's rate."""

    name: str
    position: int | None
    baseline: float
    measured: float
    status: Status

    @property
    def delta(self) -> float:
        return self.measured - self.baseline

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "position": self.position,
            "baseline": self.baseline,
            "measured": self.measured,
            "delta": self.delta,
            "status": self.status,
        }


@dataclass(frozen=True, slots=True)
class Comparison:
    rtol: float
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(c.status != "FAIL" for c in self.checks)


def check_rtol(rtol: float) -> None:
    if not 0 <= rtol < 1:
        raise WarmcapError(f"--rtol must be in [0, 1) (0.05 is 5%); got {rtol}")


def compare(baseline: Acceptance, measured: Acceptance, rtol: float = DEFAULT_RTOL) -> Comparison:
    """Judge each number against the baseline: FAIL when it fell by more than ``rtol`` (relative),
    HIGH when it rose by more (not a regression, but the baseline no longer describes the run)."""
    check_rtol(rtol)
    if len(baseline.accepted_per_pos) != len(measured.accepted_per_pos):
        raise WarmcapError(
            f"the baseline has {len(baseline.accepted_per_pos)} draft positions, the run "
            f"{len(measured.accepted_per_pos)}: they measured different settings"
        )
    pairs = [("acceptance length", None, baseline.acceptance_length, measured.acceptance_length)]
    pairs += [
        (f"position {i}", i, b, m)
        for i, (b, m) in enumerate(zip(baseline.per_position_rates, measured.per_position_rates, strict=True))
    ]
    return Comparison(rtol, tuple(Check(n, p, b, m, _status(b, m, rtol)) for n, p, b, m in pairs))


def _status(baseline: float, measured: float, rtol: float) -> Status:
    # NOTE: isclose first, so a run equal to its baseline passes at rtol 0 despite float rounding.
    if math.isclose(measured, baseline, rel_tol=1e-12, abs_tol=1e-12):
        return "PASS"
    if measured < baseline * (1 - rtol):
        return "FAIL"
    if measured > baseline * (1 + rtol):
        return "HIGH"
    return "PASS"
