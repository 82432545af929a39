"""The persistent start-up cache: graph verdicts that are a pure function of their inputs.

Two verdicts of graph start-up cost seconds and depend only on what went into them:

- the CUDA-safety verdict of each phase (:func:`warmcap.graphs.proof.safety.check_graph_safe`, a
  fake-tensor trace of the forward: a function of the code, torch, the model's structure and the
  graph's shape);
- each graph's verification (:mod:`warmcap.graphs.proof.verify`): replay vs eager on seeded random
  inputs per graph. On a CPU the kernels are deterministic for a given torch build, ISA, thread
  count and weights, so the same key gives the same numbers, bit for bit.

One JSON file per :class:`StartupKey` holds both (``<digest>.json`` under
:func:`startup_cache_dir`), and the layout (shape and dtype) of each ``static`` graph's outputs:
``static`` records nothing, so its capture's only product is those buffers, and with the layout
cached a warm start allocates them without running the capture's forward passes
(:mod:`warmcap.graphs.capture.capturer`). The key covers everything that can change a verdict:

- warmcap's own source (:func:`warmcap.source.source_digest`: every Python, data and C kernel
  file of the package; an edited file is a new key even without a new version) and the
  environment switches that pick its CPU kernels (:data:`KERNEL_ENV`);
- torch's version, the Python version, the CPU ISA torch dispatches to, the thread count, the
  device, dtype and graph backend;
- the weights *by content*: a sha256 of the bytes of every parameter and buffer of every module a
  graph runs (the target model and the drafter's modules, as loaded: this rank's shard, in the
  dtype it runs), computed at every start (:func:`weights_digest`). Never a file's size or
  modification time: an edit that keeps both is seen, a ``touch`` that changes no byte is not a
  new key. It costs a pass over the weights at hashing speed (~1 GB/s a core, spread over
  threads), against the seconds of verification it saves;
- the rest of the model directory by content (``config.json``, tokenizer files; weight files are
  named only, their bytes enter through the modules above);
- the engine config (``repr`` of the finished :class:`~warmcap.config.EngineConfig`), the KV pool
  size and every graph spec of the plan.

Warm starts still verify one graph per phase for real (the least recently checked: over a few
starts every graph is re-checked); a spot check that disagrees with its cached verdict marks the
whole entry stale, and :mod:`warmcap.graphs.startup` re-verifies every graph. A corrupt or
unreadable entry is ignored with a warning and rewritten.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from warmcap.graphs.capture.layouts import OutputLayout
from warmcap.graphs.proof.safety import GraphSafety
from warmcap.graphs.proof.verify import GraphCheck
from warmcap.source import source_digest

if TYPE_CHECKING:
    from warmcap.graphs.capture.planning import GraphSpec

log = logging.getLogger("warmcap.startup")

#: moves the start-up cache (default: ``startup/`` in the warmcap cache, next to the models)
CACHE_ENV = "WARMCAP_STARTUP_CACHE"
#: bumped when an entry's layout changes; older entries are ignored and rewritten
ENTRY_VERSION = 3
#: weight files in a model directory: their bytes enter the key as loaded (:func:`weights_digest`)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
#: environment switches that choose the kernels a forward runs (``kernels``, ``models``; the
#: CUDA fused ops; MKL's dispatch level, which sets a GEMM's rounding)
KERNEL_ENV = (
    "WARMCAP_CPU_ATTENTION",
    "WARMCAP_CPU_GEMM",
    "WARMCAP_CPU_LAYER_OPS",
    "WARMCAP_CPU_ISA",
    "WARMCAP_EXACT_GREEDY_HEAD",
    "WARMCAP_FUSED_OPS",
    "MKL_ENABLE_INSTRUCTIONS",
)


def startup_cache_dir() -> Path:
    """``$WARMCAP_STARTUP_CACHE``, else ``startup/`` under the warmcap cache (``$WARMCAP_CACHE``)."""
    moved = os.environ.get(CACHE_ENV)
    if moved:
        return Path(moved).expanduser()
    from warmcap.paths import cache_dir

    return cache_dir() / "startup"


def model_fingerprint(model_dir: Path) -> str:
    """The model directory as the key sees it: every file by name, all but weight files by content
    (the weights' bytes are :func:`weights_digest`'s)."""
    h = hashlib.sha256()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(model_dir)).encode())
        if path.suffix not in WEIGHT_SUFFIXES:
            h.update(b"=" + hashlib.sha256(path.read_bytes()).digest())
        h.update(b"\0")
    return h.hexdigest()


def weights_digest(modules: Iterable[nn.Module]) -> str:
    """sha256 over the name, dtype, shape and bytes of every parameter and buffer of ``modules``
    (a tensor shared by two modules counted once, in the order first seen). Each tensor is hashed
    on its own, in parallel threads (hashlib releases the GIL), and the digests are combined."""
    tensors: dict[int, tuple[str, torch.Tensor]] = {}
    seen: set[int] = set()
    for i, module in enumerate(modules):
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            tensors.setdefault(id(t), (f"{i}.{name}", t))

    def digest(t: torch.Tensor) -> bytes:
        data = t.detach().contiguous().cpu().reshape(-1)
        if data.dtype == torch.bool:
            data = data.to(torch.uint8)
        return hashlib.sha256(memoryview(data.view(torch.uint8).numpy())).digest()

    items = list(tensors.values())
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda item: digest(item[1]), items))
    h = hashlib.sha256()
    for (name, t), d in zip(items, digests, strict=True):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}=".encode() + d)
    return h.hexdigest()


def kernel_switches() -> str:
    """The values of :data:`KERNEL_ENV` (unset: empty)."""
    return ";".join(f"{name}={os.environ.get(name, '')}" for name in KERNEL_ENV)


def machine_parts(device: torch.device) -> dict[str, str]:
    """What of the machine and its libraries a verdict depends on."""
    parts = {
        "torch": torch.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "machine": platform.machine(),
        "device": str(device),
        "threads": str(torch.get_num_threads()),
    }
    if device.type == "cpu":
        parts["cpu_isa"] = torch.backends.cpu.get_cpu_capability()
    elif device.type == "cuda" and torch.cuda.is_available():
        parts["gpu"] = torch.cuda.get_device_name(device)
    return parts


@dataclass(frozen=True, slots=True)
class StartupKey:
    """Everything a cached verdict depends on, by name (module docstring)."""

    parts: dict[str, str]

    @classmethod
    def build(
        cls,
        *,
        device: torch.device,
        model_dir: Path,
        modules: Iterable[nn.Module],
        config: Any,
        backend: str,
        num_blocks: int,
        specs: Iterable[GraphSpec],
    ) -> StartupKey:
        return cls(
            {
                "warmcap_source": source_digest(),
                "kernels": kernel_switches(),
                **machine_parts(device),
                "model": model_fingerprint(model_dir),
                "weights": weights_digest(modules),
                "config": repr(config),
                "backend": backend,
                "num_blocks": str(num_blocks),
                "graphs": "; ".join(repr(s) for s in specs),
            }
        )

    @property
    def digest(self) -> str:
        """File name stem of the entry: sha256 of the parts."""
        return hashlib.sha256(json.dumps(self.parts, sort_keys=True).encode()).hexdigest()[:32]


@dataclass(slots=True)
class CachedCheck:
    """A graph's verification as cached, and when it was last run for real (epoch seconds)."""

    check: GraphCheck
    checked_at: float


@dataclass(slots=True)
class StartupCache:
    """One key's entry: CUDA-safety verdicts, verifications and ``static`` output layouts, each by
    graph label.

    Reads happen once (:meth:`open`), writes once (:meth:`save`, atomic); ``hits``/``misses``
    count lookups in this run.
    """

    directory: Path
    key: StartupKey
    safety: dict[str, GraphSafety] = field(default_factory=dict)
    checks: dict[str, CachedCheck] = field(default_factory=dict)
    layouts: dict[str, OutputLayout] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    #: why the entry on disk was not used (empty: absent or used)
    ignored: str = ""

    @property
    def path(self) -> Path:
        return self.directory / f"{self.key.digest}.json"

    @classmethod
    def open(cls, directory: Path, key: StartupKey) -> StartupCache:
        """The entry for ``key`` (empty when there is none, or it cannot be read: warned)."""
        entry = cls(directory, key)
        path = entry.path
        try:
            raw = path.read_text()
        except FileNotFoundError:
            return entry
        except OSError as e:
            return entry._ignore(f"cannot be read ({e})")
        try:
            data = json.loads(raw)
            if data.get("version") != ENTRY_VERSION:
                return entry._ignore(f"has version {data.get('version')!r}, not {ENTRY_VERSION}")
            if data.get("key") != key.parts:
                return entry._ignore("was written for another key (hash collision or hand edit)")
            entry.safety = {label: GraphSafety(**v) for label, v in data["safety"].items()}
            entry.checks = {
                label: CachedCheck(_check_from(v["check"]), float(v["checked_at"]))
                for label, v in data["checks"].items()
            }
            entry.layouts = {label: OutputLayout.from_json(v) for label, v in data["layouts"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            entry.safety, entry.checks, entry.layouts = {}, {}, {}
            return entry._ignore(f"is corrupt ({type(e).__name__}: {e})")
        return entry

    def _ignore(self, why: str) -> StartupCache:
        self.ignored = f"start-up cache entry {self.path} {why}: ignored, it will be rebuilt"
        log.warning(self.ignored)
        return self

    def cached_safety(self, label: str) -> GraphSafety | None:
        """The cached CUDA-safety verdict of ``label`` (None: not cached; counted)."""
        found = self.safety.get(label)
        self._count(found is not None)
        return found

    def cached_checks(self, labels: list[str]) -> dict[str, CachedCheck] | None:
        """Cached verifications of every graph in ``labels``, or None unless all are cached."""
        found = {label: self.checks[label] for label in labels if label in self.checks}
        complete = len(found) == len(labels)
        self._count(complete, len(labels))
        return found if complete else None

    def cached_layouts(self, labels: list[str]) -> dict[str, OutputLayout] | None:
        """Cached output layouts of every graph in ``labels``, or None unless all are cached."""
        found = {label: self.layouts[label] for label in labels if label in self.layouts}
        complete = len(found) == len(labels)
        self._count(complete, len(labels))
        return found if complete else None

    def _count(self, hit: bool, n: int = 1) -> None:
        if hit:
            self.hits += n
        else:
            self.misses += n

    def save(self, *, checked_now: Iterable[GraphCheck] = (), keep_checks: bool = True) -> None:
        """Write the entry atomically (a reader sees the old file or the new one). Checks run in
        this run get the current time; ``keep_checks=False`` drops the others (a stale entry).
        A failure to write is warned about, never raised: the cache is an optimisation."""
        now = time.time()
        if not keep_checks:
            self.checks = {}
        for check in checked_now:
            self.checks[check.label] = CachedCheck(check, now)
        data = {
            "version": ENTRY_VERSION,
            "key": self.key.parts,
            "safety": {label: asdict(s) for label, s in self.safety.items()},
            "checks": {
                label: {"check": _check_dict(c.check), "checked_at": c.checked_at}
                for label, c in self.checks.items()
            },
            "layouts": {label: layout.to_json() for label, layout in self.layouts.items()},
        }
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("start-up cache %s could not be written (%s): the next start verifies again", tmp, e)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


def _check_dict(check: GraphCheck) -> dict[str, Any]:
    data = asdict(check)
    # JSON has no NaN: an unverifiable graph's diffs are NaN; None stands for them.
    for key in ("max_abs_diff", "real_rows_max_abs_diff"):
        if not math.isfinite(data[key]):
            data[key] = None
    return data


def _check_from(data: dict[str, Any]) -> GraphCheck:
    values = dict(data)
    for key in ("max_abs_diff", "real_rows_max_abs_diff"):
        values[key] = float("nan") if values[key] is None else float(values[key])
    check = GraphCheck(**values)
    if not isinstance(check.verified, bool) or not isinstance(check.label, str):
        raise TypeError(f"verdict of {check.label!r} is not a bool")
    return check


def same_verdict(cached: GraphCheck, fresh: GraphCheck) -> bool:
    """Does a spot check reproduce its cached verdict? Same outcome, same batch, same numbers
    (NaN matching NaN: an unverifiable graph stays unverifiable)."""

    def same(a: float, b: float) -> bool:
        return (math.isnan(a) and math.isnan(b)) or a == b

    return (
        cached.verified == fresh.verified
        and cached.greedy_match == fresh.greedy_match
        and cached.reason == fresh.reason
        and (cached.num_real_tokens, cached.num_real_reqs) == (fresh.num_real_tokens, fresh.num_real_reqs)
        and same(cached.max_abs_diff, fresh.max_abs_diff)
        and same(cached.real_rows_max_abs_diff, fresh.real_rows_max_abs_diff)
    )


def enable_compile_cache(directory: Path) -> None:
    """Point torch's inductor cache (FX graphs, AOT-autograd graphs, generated kernels: all on by
    default in torch) into ``directory/inductor`` (``--backend compile``), unless the user chose
    one. NOTE: process-wide environment; inductor fixes its directory the first time it compiles,
    so a process that compiled before start-up keeps the one it had."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(directory / "inductor"))
