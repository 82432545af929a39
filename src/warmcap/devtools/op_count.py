"""Count the ops one call runs: the CPU proxy for CUDA kernels per step, and on CUDA the kernels.

The call runs under ``torch.profiler``; the counter walks the tree of recorded ops. An op that
aliases (a view, ``reshape``, ``to`` that may return its input) is looked through: what it calls
counts instead, so a ``to`` that converts counts its one copy and one that does not counts nothing.
A bare allocation counts nothing. Any other op counts once, as a whole: on a GPU it is (at least)
one kernel launch, however torch's CPU build implements it. An op of another namespace than
``aten`` (a ``torch.library`` custom op such as the fused Triton ops of ``models/fused_ops.py``, or
a compiled CPU kernel registered as one) counts once, its body unseen. Ops inside given modules (a
model's decoder layers) are counted apart, so a decode step reads as ops per step and per layer.
On CUDA the device kernels are counted too (:attr:`OpCounts.kernels`, :attr:`OpCounts.kernels_in_layers`).

NOTE: the dispatcher-level alternative, a ``TorchDispatchMode``, misses ``Tensor.to`` under
inference mode (every runner step runs in it), and the compiled CPU kernels step aside for torch's
ops under any dispatch mode; the profiler sees both as they run.

Used by ``tests/devtools/test_op_count.py`` (a bound that fails on regressions) and
``benchmarks/bench_ops_per_step.py`` (ops per decode step per layer).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import Any, TypeVar

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")

#: the profiler range each counted module's forward runs in
LAYER_RANGE = "warmcap::counted_layer"
#: the profiler range each call of a counted attention backend's ``forward`` runs in
ATTENTION_RANGE = "warmcap::counted_attention"
#: aten ops that allocate or ask without launching work
_NO_WORK = frozenset(
    {
        "empty",
        "empty_strided",
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "result_type",
        "detach",
        "detach_",
        "lift_fresh",
        "size",
        "stride",
        "sym_size",
        "sym_stride",
        "dim",
        "is_same_size",
        "_has_compatible_shallow_copy_type",
    }
)
#: aten ops that return their input or call the op that does the work (looked through)
_LOOK_THROUGH = frozenset({"type_as", "item", "_reshape_alias"})


@cache
def _aten_kind(name: str) -> str:
    """``count``, ``through`` (count what it calls) or ``skip`` for the aten op ``name``."""
    if name in _NO_WORK:
        return "skip"
    if name in _LOOK_THROUGH:
        return "through"
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return "count"
    if any(getattr(packet, o).is_view for o in packet.overloads()):
        return "through"
    return "count"


def op_kind(name: str) -> str:
    """How the counter treats a recorded event named ``name``: ``count`` (one op), ``through``
    (its children count instead: aliasing ops and non-op ranges) or ``skip``."""
    namespace, sep, op = name.partition("::")
    if not sep or " " in name:
        return "through"  # a range or a runtime call, not an op
    if namespace != "aten":
        return "count"
    return _aten_kind(op)


@dataclass(slots=True)
class OpCounts:
    """What one counted call ran: ``total`` ops, ``in_layers`` of them inside the counted modules
    (``num_layers`` forward calls of them), each op by name, and on CUDA the device kernels."""

    total: int = 0
    in_layers: int = 0
    num_layers: int = 0
    #: ops inside the counted attention backends' ``forward`` (part of ``in_layers`` when called
    #: from a counted layer)
    in_attention: int = 0
    by_op: Counter[str] = field(default_factory=Counter)
    by_op_in_layers: Counter[str] = field(default_factory=Counter)
    kernels: int = 0
    kernels_in_layers: int = 0

    @property
    def per_layer(self) -> float:
        """Ops per counted module call (0 when none ran)."""
        return self.in_layers / self.num_layers if self.num_layers else 0.0

    @property
    def per_layer_outside_attention(self) -> float:
        """Ops per counted module call that are not the attention backend's."""
        return (self.in_layers - self.in_attention) / self.num_layers if self.num_layers else 0.0

    @property
    def kernels_per_layer(self) -> float:
        """CUDA kernels per counted module call (0 on CPU or when none ran)."""
        return self.kernels_in_layers / self.num_layers if self.num_layers else 0.0

    @property
    def outside_layers(self) -> int:
        return self.total - self.in_layers


def _walk(event: Any, counts: OpCounts, in_layer: bool, in_attention: bool = False) -> None:
    if event.name == LAYER_RANGE:
        counts.num_layers += 1
        in_layer = True
    elif event.name == ATTENTION_RANGE:
        in_attention = True
    else:
        kind = op_kind(event.name)
        if kind == "skip":
            return
        if kind == "count":
            counts.total += 1
            counts.by_op[event.name] += 1
            if in_layer:
                counts.in_layers += 1
                counts.by_op_in_layers[event.name] += 1
            counts.in_attention += in_attention
            return
    for child in event.cpu_children:
        _walk(child, counts, in_layer, in_attention)


def _kernels_under(event: Any) -> int:
    return len(getattr(event, "kernels", ())) + sum(_kernels_under(c) for c in event.cpu_children)


def _tally(events: Iterable[Any]) -> OpCounts:
    counts = OpCounts()
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    for event in cpu:
        if event.cpu_parent is None:
            _walk(event, counts, False)
    counts.kernels = sum(len(getattr(e, "kernels", ())) for e in cpu)
    counts.kernels_in_layers = sum(_kernels_under(e) for e in cpu if e.name == LAYER_RANGE)
    return counts


@contextmanager
def _layer_ranges(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Run each forward of ``modules`` inside a :data:`LAYER_RANGE` profiler range."""
    open_ranges: list[record_function] = []

    def enter(*_: Any) -> None:
        scope = record_function(LAYER_RANGE)
        scope.__enter__()
        open_ranges.append(scope)

    def leave(*_: Any) -> None:
        open_ranges.pop().__exit__(None, None, None)

    handles = []
    for module in modules:
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _attention_ranges(backends: Iterable[Any]) -> Iterator[None]:
    """Run each ``forward`` of ``backends`` inside an :data:`ATTENTION_RANGE` profiler range."""
    patched = []
    for backend in backends:
        inner = backend.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            with record_function(ATTENTION_RANGE):
                return _inner(*args, **kwargs)

        backend.forward = forward
        patched.append(backend)
    try:
        yield
    finally:
        for backend in patched:
            del backend.forward


def count_ops(
    fn: Callable[[], T], layers: Iterable[nn.Module] = (), attention: Iterable[Any] = ()
) -> tuple[T, OpCounts]:
    """Run ``fn()`` once under the profiler and count its ops (module docstring); ops inside a
    forward of any of ``layers`` also count as in-layer ops, those inside a ``forward`` of any of
    the ``attention`` backends as attention ops. Returns ``fn``'s result and the counts; on a
    machine with CUDA the device kernels are counted too."""
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with _layer_ranges(layers), _attention_ranges(attention), profile(activities=activities) as prof:
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return result, _tally(prof.events())


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a warmcap causal LM (``model.model.layers``)."""
    return list(model.model.layers)


def decode_step_ops(engine: Any, prompt_token_ids: list[int], *, max_tokens: int = 8) -> OpCounts:
    """The ops of one pure decode step of ``engine`` (an ``LLMEngine``) at batch 1: a request with
    ``prompt_token_ids`` is prefilled and its first decode step run (so every lazy one-time set-up
    is done), then one more ``engine.step()`` is counted, with the target model's decoder layers
    as the layers and the runner's full-attention backend as the attention. The request is aborted
    afterwards, so the engine is left as it was found."""
    from warmcap.contracts.backends import AttentionBackend
    from warmcap.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req_id = engine.add_request({"prompt_token_ids": list(prompt_token_ids)}, params)
    try:
        engine.step()  # the prompt
        engine.step()  # a first decode step, uncounted
        runner = engine.runner
        attention = [runner.backends.get("full", AttentionBackend)]
        _, counts = count_ops(engine.step, decoder_layers(runner.model), attention)
    finally:
        engine.abort(req_id)
    return counts
