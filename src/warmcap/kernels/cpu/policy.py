"""When a compiled CPU kernel is used: the switch each kernel family has (``auto``, ``torch``,
``kernel``), the tensors a kernel may be handed, and how it is called (:class:`CpuOperator`).

``auto`` (the default) uses the kernel when it builds and falls back to torch when it does not, with
one warning per machine: the process whose build failed warns, later ones find the failure recorded
(:mod:`.build`) and say so at INFO level only. ``torch`` never uses the kernel; ``kernel`` requires it
and fails start-up when it cannot be built.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from warmcap.config import CPU_KERNEL_MODES, kernel_default
from warmcap.errors import ConfigError
from warmcap.kernels.cpu.build import KernelBuildError, load_library

Mode = Literal["auto", "torch", "kernel"]


def kernel_mode(field: str, mode: str | None) -> Mode:
    """``mode``, or when None the default of the kernel config's ``field`` (its environment
    variable, else ``auto``: ``config.KernelConfig``); ConfigError for anything else."""
    if mode is None:
        mode = kernel_default(field)
    if mode not in CPU_KERNEL_MODES:
        raise ConfigError(
            f"{field} {mode!r} is not a CPU kernel mode; use one of {', '.join(CPU_KERNEL_MODES)}"
        )
    return mode  # type: ignore[return-value]


def load_by_mode(
    field: str,
    mode: str | None,
    source: str,
    *,
    what: str,
    instead: str,
    log: logging.Logger,
    bind: Callable[[ctypes.CDLL], object] | None = None,
) -> ctypes.CDLL | None:
    """The library built from ``source`` as the kernel config's ``field`` (set to ``mode``; None:
    its default) allows: None in ``torch`` mode, or in ``auto`` mode when it cannot be built (then a warning on ``log`` naming ``what`` is unavailable and
    ``instead`` runs, or an INFO line when the failure is an earlier process's, recorded in the
    cache); ``kernel`` mode raises :class:`ConfigError` instead. ``bind(lib)`` runs on the loaded
    library first, and may refuse it with a :class:`KernelBuildError` of its own."""
    mode = kernel_mode(field, mode)
    if mode == "torch":
        return None
    try:
        lib = load_library(source)
        if bind is not None:
            bind(lib)
        return lib
    except KernelBuildError as exc:
        if mode == "kernel":
            raise ConfigError(f"{field} 'kernel' but {what} cannot be built: {exc}") from exc
        level = logging.INFO if exc.recorded else logging.WARNING
        flag = "--" + field.replace("_", "-")
        log.log(level, "%s is unavailable, using %s (set %s torch to silence): %s", what, instead, flag, exc)
        return None


def kernel_can_take(*tensors: torch.Tensor) -> bool:
    """Whether a compiled kernel's operator (``torch.ops.warmcap``) may be handed these tensors:
    float32 on CPU, with no gradient to record (the operators have no backward; autograd keeps
    torch's ops). Fake tensors and torch.compile's tracing are fine: they run the operator's fake
    implementation."""
    grad = torch.is_grad_enabled()
    for x in tensors:
        if x.device.type != "cpu" or x.dtype != torch.float32:
            return False
        if grad and x.requires_grad:
            return False
    return True


class CpuOperator:
    """A compiled kernel as the torch operator ``warmcap::<name>``, and the door its callers use.

    Registered with ``torch.library`` (schema, CPU implementation ``impl``, fake implementation
    ``fake``), so whatever watches operators sees it: fake tensors and ``torch.compile`` run the fake
    implementation, a ``TorchDispatchMode`` (the graph safety pass, ``graphs/proof/safety.py``) and
    ``torch.profiler`` (the op counts, ``devtools/op_count.py``) see each call. Calling the operator
    costs torch's dispatcher and its Python-kernel bridge, ~10 us a call (measured: RMSNorm of one
    64-wide row 17 us through ``torch.ops``, 7.6 us calling the implementation), which at decode
    sizes is more than the kernel: a step of a 30-layer model makes ~240 such calls. So
    :meth:`__call__` runs ``impl`` itself when nothing could watch the call (:func:`unwatched`), and
    the operator otherwise; both run the same code on the same tensors.
    """

    def __init__(
        self,
        name: str,
        schema: str,
        impl: Callable[..., Any],
        fake: Callable[..., Any],
        *,
        status_error: Callable[[Any], BaseException] | None = None,
    ) -> None:
        qualified = f"warmcap::{name}"
        #: the exception a C call of ``impl`` returning ``status`` stands for, raised by a recorded
        #: replay whose call returns another status than at capture (None: a generic error)
        self.status_error = status_error
        torch.library.define(qualified, schema)
        torch.library.register_fake(qualified, fake)
        torch.library.impl(qualified, "CPU", impl)
        self.impl = impl
        #: the registered operator (``torch.ops.warmcap.<name>.default``)
        self.op = getattr(torch.ops.warmcap, name).default
        OPERATORS[qualified] = self

    def __call__(self, *args: Any) -> Any:
        if unwatched(args):
            return self.impl(*args)
        return self.op(*args)


#: every compiled kernel's operator by its qualified name (``warmcap::gemm``)
OPERATORS: dict[str, CpuOperator] = {}


def unwatched(args: tuple[Any, ...]) -> bool:
    """Whether an operator call with ``args`` could be seen by nothing but its result: not traced by
    ``torch.compile``, no torch-function or dispatch mode active, the profiler off, and every
    argument a plain ``torch.Tensor`` (not a fake or other subclass), number or None (not a tracer's
    proxy)."""
    if torch.compiler.is_compiling():
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack():
        return False
    if torch._C._autograd._profiler_enabled():
        return False
    for a in args:
        if type(a) is torch.Tensor or a is None or type(a) in (int, float, bool):
            continue
        return False
    return True


#: where this thread's C calls are reported while a recording watches them (:func:`c_calls_to`)
_sinks = threading.local()

#: ``sink(fn, args, result)``: told of each C call a recording watches
CallSink = Callable[[Any, tuple[Any, ...], Any], None]


def c_call(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` for a C entry point of a compiled kernel, reported to the sink of a recording
    in progress on this thread (:func:`c_calls_to`). Every kernel implementation calls its C code
    through here, so a recorded CPU graph (``graphs/capture/cpu_program.py``) sees each launch with
    the exact arguments (pointers, sizes, thread count) it was made with."""
    result = fn(*args)
    sink = getattr(_sinks, "sink", None)
    if sink is not None:
        sink(fn, args, result)
    return result


@contextmanager
def c_calls_to(sink: CallSink | None, scratch: dict[int, torch.Tensor] | None = None) -> Iterator[None]:
    """Report this thread's :func:`c_call` launches to ``sink`` inside the block (None: to nobody),
    and take the work buffers of those launches from ``scratch`` (:func:`launch_scratch`; None: the
    kernels' own); what was set outside the block is restored after."""
    before = getattr(_sinks, "sink", None), getattr(_sinks, "scratch", None)
    _sinks.sink, _sinks.scratch = sink, scratch
    try:
        yield
    finally:
        _sinks.sink, _sinks.scratch = before


def host_sync(what: str) -> None:
    """Tell a recording in progress on this thread (:func:`host_syncs_to`) that the caller waits on
    the host for something no recorded call would wait for again (a collective whose waits are
    Python): the recording refuses, naming ``what``. Nothing happens outside a recording."""
    refuse = getattr(_sinks, "host_sync", None)
    if refuse is not None:
        refuse(what)


@contextmanager
def host_syncs_to(refuse: Callable[[str], None] | None) -> Iterator[None]:
    """Report this thread's :func:`host_sync` calls to ``refuse`` inside the block."""
    before = getattr(_sinks, "host_sync", None)
    _sinks.host_sync = refuse
    try:
        yield
    finally:
        _sinks.host_sync = before


def launch_scratch(floats: int) -> torch.Tensor | None:
    """A float32 work buffer of at least ``floats`` for a C launch a recording watches, owned by the
    recording (one per size, never reallocated: its launches replay with its address, on whatever
    thread, while another engine's kernels use their own); None when no recording gave one."""
    pool = getattr(_sinks, "scratch", None)
    if pool is None:
        return None
    buf = pool.get(floats)
    if buf is None:
        buf = pool[floats] = torch.empty(floats, dtype=torch.float32)
    return buf
