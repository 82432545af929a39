"""Would a graph's forward record as a CUDA graph? A CPU answer with fake tensors.

The ``static`` backend runs a graph's forward eagerly, so it cannot tell whether the same code
would survive ``torch.cuda.graph`` capture. :func:`check_graph_safe` runs the exact forward the
capturer records (:meth:`GraphCapturer.forward`) under ``FakeTensorMode`` with every tensor it
touches replaced by a fake: model parameters and buffers (every subject's modules), the KV
cache tensors, the static step buffers (and the drafter's buffers) and every tensor field of the
attention metadata. Fakes have shapes but no data, so what a capture cannot record raises:

- host reads of device data (``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``, ``torch.equal``):
  a sync inside capture;
- data-dependent shapes (``torch.nonzero``, ``torch.unique``, boolean-mask indexing);
- any op on a host copy (``*_cpu`` metadata and buffers): its value at capture time would be
  baked into the graph, and replays would never see the refilled batch;
- ``Tensor.cpu()`` / ``Tensor.numpy()`` on device data (a device-to-host copy; on a CPU runner
  ``.cpu()`` is otherwise invisible, since it is a no-op there).

Boundary of the checked region (what a replay does on the host vs. what is recorded), as in the
``cuda`` backend:

- Outside, done first on the real tensors and then faked: :meth:`GraphCapturer.refresh_states`,
  the host planning of Mamba state columns into ``MambaMetadata`` read/write blocks (it reads
  host block tables and request bookkeeping; ``cuda`` runs it before recording and before every
  replay). Static entries are handed to the forward unpinned (``static=False``), so the forward
  skips its own refill exactly as it does while a CUDA stream is capturing. Planning builds new
  tensors for plain entries and refills no static entry: the graph's own blocks stay untouched.
- Outside: backend ``prepare_for_capture`` / ``prepare_for_replay`` hooks (host planning).
- Inside (checked): everything else :meth:`GraphCapturer.forward` does, from the embedding to the
  last norm, the attention backend included.

Nothing real is written: the runner runs the forward over fake buffers and caches through its
scoped ``ModelRunner.substituted``, module parameters are swapped for fakes and restored in a
``finally``, along with the attention backend's plan caches. A real tensor the check did not fake is never written either: an
op that would write one stops the check (reported as not safe, "check incomplete").

Scope: backends written in torch ops (``torch``, ``torch_mla``). Kernels without a fake
implementation (FlashInfer) cannot run on fakes and are reported as a failed check.
"""

from __future__ import annotations

import copy
import sysconfig
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from warmcap.graphs.capture.planning import GraphSpec, plan_draft_graphs, plan_target_graphs
from warmcap.models.packed_linear import running_unpacked
from warmcap.runner_v2.mamba_state import MambaMetadata

if TYPE_CHECKING:
    from types import TracebackType

    from warmcap.contracts import AttentionMetadata
    from warmcap.graphs.capture.capturer import CapturedGraph, GraphCapturer

_TORCH_DIR = str(Path(torch.__file__).parent)
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # holds ``warmcap/`` (this is warmcap/graphs/proof/)
#: ops that only ask for metadata (device, sizes): touching a host copy's shape reads no data
_METADATA_NAMESPACES = ("prim",)


@dataclass(frozen=True, slots=True)
class GraphSafety:
    """Whether a graph's forward would record under CUDA graph capture; ``reason`` (when not safe):
    the op, why, and the innermost source line that ran it."""

    safe: bool
    reason: str = ""


class _Unsafe(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def check_graph_safe(
    capturer: GraphCapturer,
    graph: CapturedGraph | GraphSpec,
    metas: Mapping[str, AttentionMetadata] | None = None,
) -> GraphSafety:
    """Run ``graph``'s forward on fake tensors and say whether CUDA graph capture would record it.

    ``metas``: the graph's static metadata (default: a :class:`CapturedGraph`'s own). Call it with
    the graph's inputs loaded (as right after its capture): the host-side Mamba planning in front
    of the recorded region reads them. No real tensor, buffer or cache is written.
    """
    if isinstance(graph, GraphSpec):
        spec = graph
    else:
        spec, metas = graph.spec, graph.metas if metas is None else metas
    if metas is None:
        raise ValueError(f"check_graph_safe needs the static metadata of {spec.label!r} (metas=...)")
    capturer.subject(spec)  # a ConfigError when the runner has nothing this graph records
    planned = _host_prelude(capturer, spec, dict(metas))
    faker = _Faker(FakeTensorMode(allow_non_fake_inputs=True), capturer.runner.device)
    try:
        fake_metas = {group: faker.metadata(meta) for group, meta in planned.items()}
        with (
            _fakes_installed(capturer, faker),
            torch.inference_mode(),
            faker.mode,
            _Guard(faker.host),
            _DeviceToHost(faker.host),
        ):
            capturer.forward(spec, fake_metas)
    except Exception as e:
        # Any failure on fakes means the forward could not be shown to record; say which and where.
        return GraphSafety(False, f"{_describe(e)} at {_where(e.__traceback__)}")
    return GraphSafety(True)


def phase_safety(
    capturer: GraphCapturer,
    graphs: list[CapturedGraph],
    cached: Callable[[str], GraphSafety | None] = lambda label: None,
) -> dict[str, GraphSafety]:
    """The CUDA-safety verdict of each phase, by the label of its largest graph (the first of its
    phase in capture order): the code path depends on the phase, not the size, so that graph
    stands for it. A verdict ``cached(label)`` finds (the start-up cache's) is taken as is; the others are
    traced, with the graph's capture inputs (all padding) loaded again first. An unsafe phase the
    ``cuda`` plan would not capture anyway says so (that plan runs it eagerly)."""
    verdicts: dict[str, GraphSafety] = {}
    phases: set[str] = set()
    for graph in graphs:
        spec = graph.spec
        if spec.phase in phases:
            continue
        phases.add(spec.phase)
        found = cached(spec.label)
        if found is None:
            capturer.load(spec)
            found = _explained(capturer, spec, check_graph_safe(capturer, graph))
        verdicts[spec.label] = found
    return verdicts


def _explained(capturer: GraphCapturer, spec: GraphSpec, safety: GraphSafety) -> GraphSafety:
    if safety.safe:
        return safety
    runner = capturer.runner
    cuda_target = plan_target_graphs(
        runner, capture_sizes=capturer.capture_sizes, backend="cuda", graph_shapes=capturer.graph_shapes
    )
    drafts = plan_draft_graphs(runner, cuda_target, backend="cuda", graph_shapes=capturer.graph_shapes)
    cuda_specs = [*cuda_target.specs, *drafts.specs]
    if spec.label in {s.label for s in cuda_specs}:
        return safety
    return replace(safety, reason=f"{safety.reason}; the cuda plan runs this phase eagerly")


def _host_prelude(
    capturer: GraphCapturer, spec: GraphSpec, metas: dict[str, AttentionMetadata]
) -> dict[str, AttentionMetadata]:
    """The host work in front of the recorded region, on the real tensors (module docstring)."""
    return _unpinned(capturer.refresh_states(spec, _unpinned(metas)))


def _unpinned(metas: dict[str, AttentionMetadata]) -> dict[str, AttentionMetadata]:
    """Static Mamba entries as plain ``MambaMetadata`` over the same tensors.

    NOTE: a static entry is refilled on the host by every pass unless a CUDA stream is capturing,
    which a CPU run never is; unpinned, the forward uses it as is, as it would under capture, and
    planning never writes the graph's real read/write blocks.
    """
    return {
        g: replace(m, static=False) if isinstance(m, MambaMetadata) and m.static else m
        for g, m in metas.items()
    }


class _Faker:
    """Fakes of real tensors (one per tensor, views sharing fake storage), remembering host copies."""

    def __init__(self, mode: FakeTensorMode, device: torch.device) -> None:
        self.mode = mode
        self.device = device
        #: id(fake) -> name, for every fake of a host copy (kept alive by ``_keep``)
        self.host: dict[int, str] = {}
        self._keep: list[torch.Tensor] = []

    def tensor(self, t: torch.Tensor, name: str) -> torch.Tensor:
        fake = self.mode.from_tensor(t)
        if name.endswith("_cpu") or (t.device.type == "cpu" and self.device.type != "cpu"):
            self.host[id(fake)] = name
            self._keep.append(fake)
        return fake

    def value(self, value: Any, name: str) -> Any:
        """A tensor or a dict of tensors faked; anything else as is."""
        if isinstance(value, torch.Tensor):
            return self.tensor(value, name)
        if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
            return {k: self.tensor(v, f"{name}[{k!r}]") for k, v in value.items()}
        return value

    def metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        changes = {
            f.name: self.tensor(v, f.name)
            for f in fields(meta)
            if isinstance(v := getattr(meta, f.name), torch.Tensor)
        }
        return replace(meta, **changes)

    def copy(self, obj: Any) -> Any:
        """A shallow copy of ``obj`` whose tensor (and dict-of-tensor) attributes are fakes."""
        out = copy.copy(obj)
        for name, value in vars(obj).items():
            setattr(out, name, self.value(value, name))
        return out


@contextmanager
def _fakes_installed(capturer: GraphCapturer, faker: _Faker) -> Iterator[None]:
    """Run the runner over fake buffers and caches and every subject's modules over fake
    parameters; restore everything on exit."""
    runner = capturer.runner
    kv_caches = runner.kv_caches
    statics = runner.draft_executor.buffers if runner.draft_executor is not None else None
    fake_kv = copy.copy(kv_caches)
    fake_kv.tensors = {name: faker.tensor(t, name) for name, t in kv_caches.tensors.items()}
    fake_statics = None
    if statics is not None:
        fake_statics = copy.copy(statics)
        fake_statics.buffers = faker.copy(statics.buffers)
        fake_statics.features = faker.value(statics.features, "features")
    backend_state = _containers(runner.attn_backend)
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    modules = _modules(capturer)
    # NOTE: a CPU linear's oneDNN-packed weight copy is not a parameter and cannot be faked; the
    # linears multiply by their (fake) parameters instead, as they do on CUDA, which never packs.
    # Linears packed for the compiled GEMM keep their packing: its operators run on fakes.
    try:
        for module in modules:
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is not None:
                        swapped.append((table, name, t))
                        table[name] = faker.tensor(t, name)
        with (
            running_unpacked(modules, keep_compiled=True),
            runner.substituted(
                buffers=faker.copy(runner.buffers), kv_caches=fake_kv, draft_buffers=fake_statics
            ),
        ):
            yield
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t
        _restore_containers(runner.attn_backend, backend_state)


def _modules(capturer: GraphCapturer) -> list[nn.Module]:
    """Every module any of the runner's subjects may run."""
    seen: dict[int, nn.Module] = {}
    for subject in capturer.subjects.values():
        for root in subject.modules():
            for module in root.modules():
                seen.setdefault(id(module), module)
    return list(seen.values())


def _containers(obj: Any) -> dict[str, Any]:
    """Shallow copies of ``obj``'s dict and list attributes (plan caches keyed by metadata)."""
    return {k: copy.copy(v) for k, v in getattr(obj, "__dict__", {}).items() if isinstance(v, (dict, list))}


def _restore_containers(obj: Any, saved: dict[str, Any]) -> None:
    # In place: whoever holds the container keeps seeing the same object.
    for name, before in saved.items():
        current = getattr(obj, name)
        if isinstance(current, dict):
            current.clear()
            current.update(before)
        else:
            current[:] = before


def _describe(e: Exception) -> str:
    if isinstance(e, _Unsafe):
        return e.reason
    if isinstance(e, DynamicOutputShapeException):
        return f"{_op_name(e.func)} (data-dependent shape)"
    if isinstance(e, DataDependentOutputException):
        return f"{_op_name(e.func)} (host read of device data)"
    lines = str(e).strip().splitlines()
    return f"check failed: {type(e).__name__}: {lines[0][:160] if lines else ''}"


def _op_name(func: Any) -> str:
    return str(getattr(func, "overloadpacket", func))


class _Guard(TorchDispatchMode):
    """Stops at any op on a host copy, and at any write into a tensor that is not a fake."""

    def __init__(self, host: dict[int, str]) -> None:
        super().__init__()
        self.host = host

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace not in _METADATA_NAMESPACES:
            for t in tree_leaves((args, kwargs)):
                name = self.host.get(id(t)) if isinstance(t, torch.Tensor) else None
                if name is not None:
                    raise _Unsafe(
                        f"{_op_name(func)} on host copy {name} (its capture-time value would be baked in)"
                    )
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in tree_leaves(value):
                    if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
                        raise _Unsafe(
                            f"check incomplete: {_op_name(func)} writes a real tensor the check did not fake"
                        )
        return func(*args, **kwargs)


class _DeviceToHost(TorchFunctionMode):
    """``Tensor.cpu()`` / ``.numpy()`` on device data: a device-to-host copy (a no-op on CPU,
    so fakes cannot catch it)."""

    def __init__(self, host: dict[int, str]) -> None:
        super().__init__()
        self.host = host

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        device_data = bool(args) and isinstance(args[0], FakeTensor) and id(args[0]) not in self.host
        if device_data and func in (torch.Tensor.cpu, torch.Tensor.numpy):
            raise _Unsafe(f"Tensor.{func.__name__} (device-to-host copy)")
        return func(*args, **(kwargs or {}))


def _where(tb: TracebackType | None) -> str:
    """The innermost frame outside torch, the stdlib and this module, as ``warmcap/...:line``."""
    here = str(Path(__file__).resolve())
    frames = [
        f
        for f in traceback.extract_tb(tb)
        if not f.filename.startswith((_TORCH_DIR, _STDLIB_DIR)) and str(Path(f.filename).resolve()) != here
    ]
    if not frames:
        return "<unknown>"
    frame = frames[-1]
    path = Path(frame.filename).resolve()
    shown = path.relative_to(_PACKAGE_ROOT) if path.is_relative_to(_PACKAGE_ROOT) else Path(path.name)
    return f"{shown.as_posix()}:{frame.lineno}"
