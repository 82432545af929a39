"""``warmup accept``: run a fixed prompt set and measure speculative acceptance.

Acceptance is read the way an operator reads it in production: from the spec-decode counters
under vLLM's names (:mod:`warmcap.accept.counters`), in-process or from a server's ``/metrics``,
so the paths cannot disagree on what the numbers mean. A run is the difference of the counters
after and before the prompt set; :mod:`warmcap.accept.baseline` compares it with a baseline.

Prompts go one at a time, greedy, in every path. NOTE: batch composition can move float sums and
so a greedy tie; one request at a time makes in-process, server and proxy runs agree exactly.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from warmcap.accept.counters import read_acceptance
from warmcap.errors import WarmcapError
from warmcap.metrics import SpecDecodeMetrics

if TYPE_CHECKING:
    from warmcap.config import SpeculativeConfig

PROMPT_SET = "accept_prompts.jsonl"
DEFAULT_MAX_TOKENS = 24
IN_PROCESS_MAX_MODEL_LEN = 512

Kind = Literal["chat", "completion"]


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
    return Path(str(resources.files("warmcap.accept") / "data" / PROMPT_SET))


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


# ---- measuring -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Measurement:
    """One pass of the prompt set: the counters it moved and the tokens it generated."""

    source: str
    acceptance: SpecDecodeMetrics
    completion_tokens: int


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
    from warmcap.core.reservation import blocks_covering
    from warmcap.llm import LLM
    from warmcap.sampling_params import SamplingParams

    # One request at a time needs blocks for one context (twice: a draft model has its own groups);
    # left unset, the pool would be sized from free memory, gigabytes on a CPU host.
    blocks = 2 * blocks_covering(IN_PROCESS_MAX_MODEL_LEN, 16) + 2
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

    def scrape() -> SpecDecodeMetrics:
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

    _check_server_spec(scrape_url.removesuffix("/metrics"), spec)
    return _measure(base, scrape, map(one, prompt_set.prompts), spec.num_speculative_tokens)


def _measure(
    source: str, read: Callable[[], SpecDecodeMetrics], requests: Iterable[int], num_positions: int
) -> Measurement:
    before = read()
    # ``requests`` is lazy: the prompts run here, between the two readings.
    tokens = sum(requests)
    return Measurement(source, read().since(before).padded(num_positions), tokens)


def _check_positions(reading: SpecDecodeMetrics, spec: SpeculativeConfig, where: str) -> None:
    # NOTE: a server exposes one per-position series per draft token from start-up, so the series
    # count is the k it drafts; more series than --spec's k means another setting is being measured.
    if len(reading.accepted_per_pos) > spec.num_speculative_tokens:
        raise WarmcapError(
            f"{where} counts acceptance at {len(reading.accepted_per_pos)} draft positions but --spec "
            f"{spec.short()} drafts {spec.num_speculative_tokens}: measure the server with its own --spec"
        )


def _check_server_spec(base: str, spec: SpeculativeConfig) -> None:
    """Refuse a warmcap server (the one whose counters are read) started with another setting:
    its ``/startup`` report names it. Servers without that endpoint (vLLM) are taken at their word."""
    import httpx

    try:
        response = httpx.get(base + "/startup", timeout=30)
        if response.status_code != 200:
            return
        # The report's spec: {"method": name or None, "k": draft tokens} (graphs/proof/report.py SpecInfo).
        served = response.json()["spec"]
        method, k = served["method"], served["k"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return
    if method is None:
        raise WarmcapError(f"the server at {base} does not speculate: start it with --spec {spec.short()}")
    if (method, k) != (spec.method, spec.num_speculative_tokens):
        raise WarmcapError(
            f"the server at {base} drafts with {method}:{k} but --spec is {spec.short()}: pass the "
            "server's own setting, or start it with --spec " + spec.short()
        )
