"""Recorded CPU graphs: a forward's kernel launches and tensor ops, replayed without its Python.

On CPU a ``static`` graph replays by running the model's forward again over its static buffers: at
decode sizes that is mostly Python (module calls, argument checks, the attention plan), ~20 us an
op, a millisecond a step on a two-layer model. A CUDA graph removes exactly that cost by recording
the launches once; :func:`record` does the same for the CPU path. It runs the forward once under a
``TorchDispatchMode`` and keeps, in order, what computes:

- each compiled-kernel operator (``torch.ops.warmcap.*``) as the C calls its implementation made,
  with their exact arguments (pointers into the static buffers, the weights, the KV cache and the
  recorded intermediates; sizes; thread count), seen through ``kernels/cpu/policy.c_call``. A C
  call that returned a value (a status) must return the same at replay, or the replay raises; the
  work buffers of those calls are the recording's own (``policy.launch_scratch``), so a replay on
  any thread never shares one with kernels running eagerly elsewhere;
- each in-place torch op (``copy_``, ``index_copy_``) as the op, called again on the same tensors;
- each functional torch op (``add``, ``where``, ``cos``) as its ``out=`` overload writing into the
  tensor the recording produced (later ops were recorded reading that tensor), or, where no such
  overload gives the same bits, as the op called again with its result copied there;
- views, aliases and fresh allocations as nothing: the recorded tensors keep their storage.

The replay (:class:`CpuProgram`) is then a flat loop over those calls: the tiny-llama decode
forward is 17 C calls and 13 torch ops instead of ~45 operator dispatches under Python modules.

What cannot be replayed this way is refused, and the graph replays eagerly as before
(:class:`Refused` says why): a value read on the host (``.item()``, ``bool(t)``, ``torch.equal``,
``.tolist()``, ``.numpy()``: the branch it decides would be baked in), an op whose output shape
depends on data, a random op, a compiled kernel whose implementation also ran torch compute, a
C launch outside any operator, or a wait on the host that code reports (``policy.host_sync``: a
tensor-parallel collective made in Python; the shared-memory all-reduce in C is recorded as its C
call, so a tensor-parallel rank's forward records). Like a CUDA graph, a recording is only as good as its static
buffers: whatever the forward derives on the host from anything but tensors (shapes, the graph's
fixed metadata) is fixed at record time, which is why every recorded graph is verified against
eager at start-up (``graphs/proof/verify.py``) before it serves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from warmcap.kernels.cpu.policy import OPERATORS, c_calls_to, host_syncs_to

#: allocations: their contents are undefined until an op writes them, so nothing to replay
_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
#: Tensor methods that read values to the host without a dispatched op
_HOST_READS = frozenset({"tolist", "numpy", "__array__"})
_REFUSED_TAGS = (
    torch.Tag.dynamic_output_shape,
    torch.Tag.data_dependent_output,
    torch.Tag.nondeterministic_seeded,
)


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a forward could not be recorded: the op and the reason."""

    reason: str


class CpuProgram:
    """A recorded forward: its calls, in order, and every object they reference, kept alive."""

    def __init__(
        self, calls: list[Callable[[], None]], keep: list[Any], kernel_calls: int, scratch_bytes: int
    ) -> None:
        self._calls = tuple(calls)
        self._keep = keep
        #: C launches among the calls
        self.kernel_calls = kernel_calls
        #: bytes of the tensors the recording allocated (intermediates and outputs), held with it
        self.scratch_bytes = scratch_bytes

    def __len__(self) -> int:
        return len(self._calls)

    def replay(self) -> None:
        """Run the recorded calls (under inference mode: the recorded tensors are inference tensors)."""
        if torch.is_inference_mode_enabled():
            for call in self._calls:
                call()
        else:
            with torch.inference_mode():
                for call in self._calls:
                    call()


def record(forward: Callable[[], Any]) -> tuple[Any, CpuProgram | Refused]:
    """Run ``forward()`` once (under inference mode) and return its result with the program that
    recomputes it in place, or with why it cannot be recorded (the result is still this run's)."""
    recorder = _Recorder()
    with (
        torch.inference_mode(),
        c_calls_to(recorder.top_level_call, recorder.scratch),
        host_syncs_to(lambda what: recorder.refuse(f"{what}: waits on the host")),
        _HostReads(recorder),
        recorder,
    ):
        result = forward()
    if recorder.refused is not None:
        return result, recorder.refused
    recorder.keep.append(recorder.scratch)
    scratch = sum(recorder.made.values()) + sum(t.nbytes for t in recorder.scratch.values())
    return result, CpuProgram(recorder.calls, recorder.keep, recorder.kernel_calls, scratch)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Callable[[], None]] = []
        self.keep: list[Any] = []
        self.kernel_calls = 0
        self.refused: Refused | None = None
        #: storage address -> bytes of every tensor the recording allocated
        self.made: dict[int, int] = {}
        #: the work buffers of the recorded launches, by size (kernels/cpu/policy.launch_scratch)
        self.scratch: dict[int, torch.Tensor] = {}

    def allocated(self, out: Any) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.made[storage.data_ptr()] = storage.nbytes()

    def refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = Refused(reason)

    def top_level_call(self, fn: Any, args: tuple[Any, ...], result: Any) -> None:
        self.refuse(f"a C call ({getattr(fn, '__name__', fn)}) made outside any warmcap operator")

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.refused is not None:
            return func(*args, **kwargs)
        if func.namespace == "warmcap":
            return self._kernel(func, args, kwargs)
        out = func(*args, **kwargs)
        why = _unreplayable(func)
        if why:
            self.refuse(f"{func}: {why}")
            return out
        self.keep.append((args, kwargs, out))
        name = func.overloadpacket.__name__
        if func._schema.is_mutable:
            self.calls.append(_Call(func, args, kwargs))
        elif not _aliases_input((args, kwargs), out):
            self.allocated(out)
            if name not in _ALLOCATIONS:
                results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                self.calls.append(_functional(func, args, kwargs, results))
        return out

    def _kernel(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        operator = OPERATORS.get(func._schema.name)
        if operator is None:
            self.refuse(f"{func}: not a compiled CPU kernel")
            return func(*args, **kwargs)
        launches: list[tuple[Any, tuple[Any, ...], Any]] = []
        inner = _Inside()
        # The implementation itself, under ``inner``: its own torch ops are seen (calling the
        # operator would show ``inner`` the operator and hide what its implementation runs).
        with c_calls_to(lambda fn, a, r: launches.append((fn, a, r)), self.scratch), inner:
            out = operator.impl(*args, **kwargs)
        if inner.computed:
            self.refuse(f"{func}: its implementation also ran {inner.computed}")
            return out
        self.keep.append((args, kwargs, out))
        self.allocated(out)
        for fn, a, r in launches:
            self.calls.append(_Launch(fn, a, r, str(func), operator.status_error))
        self.kernel_calls += len(launches)
        return out


class _Inside(TorchDispatchMode):
    """Inside a compiled kernel's implementation: notes the first op that computes (only
    allocations and views are expected there; the C calls do the work)."""

    def __init__(self) -> None:
        super().__init__()
        self.computed = ""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.computed and name not in _ALLOCATIONS and not _aliases_input((args, kwargs), out):
            self.computed = str(func)
        return out


class _HostReads(TorchFunctionMode):
    """Refuses the recording at a host read no dispatched op shows (``tolist``, ``numpy``)."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if getattr(func, "__name__", "") in _HOST_READS:
            self.recorder.refuse(f"Tensor.{func.__name__}: reads tensor values on the host")
        return func(*args, **(kwargs or {}))


def _unreplayable(func: Any) -> str:
    """Why ``func``'s call cannot be recorded ('' when it can)."""
    for tag in _REFUSED_TAGS:
        if tag in func.tags:
            return f"tagged {tag.name} (its result depends on more than its inputs' shapes)"
    for ret in func._schema.returns:
        kind = str(ret.type)
        if "Tensor" not in kind:
            return f"returns a {kind} to the host (a value read there decides what runs next)"
    return ""


def _aliases_input(args: Any, out: Any) -> bool:
    """Whether every tensor an op returned (``out``) shares storage with a tensor among its
    arguments (a view, or an op such as ``to`` that returned its input): recomputing it is not
    needed."""
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not outs:
        return False
    inputs = {t.untyped_storage().data_ptr() for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
    return all(t.untyped_storage().data_ptr() in inputs for t in outs)


@dataclass(frozen=True, slots=True)
class _Launch:
    """A C call as recorded, expected to return what it returned then."""

    fn: Any
    args: tuple[Any, ...]
    result: Any
    op: str
    #: the operator's own exception for a status (``CpuOperator.status_error``), when it has one
    error: Callable[[Any], BaseException] | None = None

    def __call__(self) -> None:
        got = self.fn(*self.args)
        if got != self.result:
            if self.error is not None:
                raise self.error(got)
            raise RuntimeError(
                f"recorded CPU graph: {self.op} returned {got} (at capture {self.result}); "
                "the graph's inputs are outside what it recorded"
            )


@dataclass(frozen=True, slots=True)
class _Call:
    """An op called again on the same tensors: an in-place op, or a functional one through its
    ``out=`` overload into the tensor the recording produced."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __call__(self) -> None:
        self.func(*self.args, **self.kwargs)


def _functional(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], results: list[torch.Tensor]) -> Any:
    """The replay of a functional op: its ``out=`` overload writing the recorded result in place
    where it has one that gives the same bits now (no allocation, no copy), else :class:`_Into`."""
    if len(results) == 1 and "out" not in kwargs:
        # ``add.Tensor`` -> ``add.out``, ``ge.Scalar`` -> ``ge.Scalar_out``
        name = func._overloadname
        out_overload = getattr(func.overloadpacket, "out" if name == "default" else f"{name}_out", None)
        if out_overload is None and name != "default":
            out_overload = getattr(func.overloadpacket, "out", None)
        if out_overload is not None and [a.name for a in out_overload._schema.arguments if a.is_out] == [
            "out"
        ]:
            kept = results[0]
            try:
                check = torch.empty_like(kept)
                out_overload(*args, **kwargs, out=check)
            except (RuntimeError, TypeError):
                pass
            else:
                if check.shape == kept.shape and check.stride() == kept.stride() and torch.equal(check, kept):
                    return _Call(out_overload, args, {**kwargs, "out": kept})
    return _Into(func, args, kwargs, results)


@dataclass(frozen=True, slots=True)
class _Into:
    """A functional op, its fresh results copied into the tensors the recording produced."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    results: list[torch.Tensor]

    def __call__(self) -> None:
        fresh = self.func(*self.args, **self.kwargs)
        if isinstance(fresh, torch.Tensor):
            self.results[0].copy_(fresh)
        else:
            for kept, new in zip(self.results, tree_leaves(fresh), strict=True):
                kept.copy_(new)
