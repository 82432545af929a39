"""The model's collectives between the tensor-parallel ranks of one machine, over shared memory.

Rank 0's group choice (:func:`open_local_group`, called by ``rendezvous.join_group`` once per
process): every rank of a gloo (CPU) group tells the others its :func:`~.shm_segment.host_key`;
when all agree, rank 0 creates a segment (:mod:`.shm_segment`), every rank maps it, and the
model's collectives (``contracts/parallel.py:all_reduce_sum``, ``all_gather_last_dim``) run on
:class:`ShmCommunicator` instead of gloo. Ranks on different machines keep gloo, CUDA keeps NCCL.
``$WARMCAP_TP_COMM`` overrides the choice: ``gloo`` keeps gloo on one machine (the A/B peer),
``shm`` requires shared memory (an error where the ranks cannot share it).

A collective: each rank copies its tensor into its own buffer (even or odd, alternating, so a
fast rank writing the next collective never overwrites what a slow rank still reads), publishes
its sequence number, waits for every peer's, and reads all buffers. The sum runs in rank order
(``x_0 + x_1 + ...``) on every rank, so every rank holds the same bits; at two ranks it is the one
addition gloo makes too, bit for bit (``tests/distributed/test_shm.py``).

A float32 all-reduce is one C call (``kernels/cpu/shm_collective.c``, the operator
``warmcap::shm_all_reduce_``): the same protocol, its sequence number kept in the segment (the
Python collectives read it there too), so a recorded CPU graph (``graphs/capture/cpu_program.py``)
replays a tensor-parallel rank's forward with its all-reduces in it. A peer that leaves or dies
during that call ends it with a status, raised as :class:`~.shm_segment.PeerGoneError` whether the
call was made eagerly or replayed. Without a C compiler the Python collective runs instead.

The mailbox (:meth:`ShmCommunicator.post` / :meth:`ShmCommunicator.fetch`, C calls too, so they
replay): one rank writes a tensor into its own mailbox for one peer, which waits for it and reads
it in place. ``models/llama.py``'s :class:`~warmcap.models.llama.KVOffload` sends a rank holding
fewer attention heads its peer's K/V projections this way. Only the C calls serve it: without a
compiler there is no mailbox (:attr:`ShmCommunicator.mail_floats` is 0) and the heads stay split.
"""

from __future__ import annotations

import ctypes
import logging
import math
from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist

from warmcap.config import TP_COMM_MODES, kernel_default
from warmcap.distributed import shm_segment
from warmcap.distributed.shm_ring import ShmRing
from warmcap.distributed.shm_segment import (
    MAIL,
    SEQ,
    SHM_DIR,
    TAKEN,
    Layout,
    PeerGoneError,
    Segment,
    host_key,
)
from warmcap.errors import ConfigError
from warmcap.kernels.cpu.build import KernelBuildError, load_library
from warmcap.kernels.cpu.policy import CpuOperator, c_call, host_sync

logger = logging.getLogger("warmcap.distributed")

#: environment switch for the transport of the ranks of one machine: auto, shm or gloo
ENV = "WARMCAP_TP_COMM"


def comm_mode(mode: str | None = None) -> str:
    """The config's ``kernel.tp_comm`` (``mode``; None: its default, ``$WARMCAP_TP_COMM``, else
    ``auto``); ConfigError for another value."""
    if mode is None:
        mode = kernel_default("tp_comm")
    if mode not in TP_COMM_MODES:
        raise ConfigError(f"tp_comm {mode!r} is not a tensor-parallel transport; use auto, shm or gloo")
    return mode


# ---- the C all-reduce -----------------------------------------------------------------------------

_ALL_REDUCE_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, *[ctypes.c_int64] * 5]


@cache
def _c_library() -> ctypes.CDLL | None:
    """``shm_collective.c``, built on first use and its entry points typed; None where it cannot
    be built (no compiler): the Python collective serves and there is no mailbox. Refused
    (RuntimeError) if its layout constants differ from :mod:`.shm_segment`'s."""
    try:
        lib = load_library("shm_collective.c")
    except KernelBuildError as exc:
        logger.info("tensor-parallel all-reduce stays in Python: %s", exc)
        return None
    got = (ctypes.c_int64 * 10)()
    lib.warmcap_shm_layout(got)
    want = (
        shm_segment.WORDS_PER_LINE,
        shm_segment.PID,
        SEQ,
        shm_segment.CLOSED,
        shm_segment.SLEEPING,
        _CLOSED,
        _GONE,
        _TIMEOUT,
        MAIL,
        TAKEN,
    )
    if tuple(got) != want:
        raise RuntimeError(f"shm_collective.c's segment layout {tuple(got)} is not shm_segment.py's {want}")
    fn = lib.warmcap_shm_all_reduce_f32
    fn.argtypes, fn.restype = _ALL_REDUCE_ARGS, ctypes.c_int64
    lib.warmcap_shm_post.argtypes, lib.warmcap_shm_post.restype = (
        [ctypes.c_void_p, *[ctypes.c_int64] * 2],
        None,
    )
    lib.warmcap_shm_fetch.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 4]
    lib.warmcap_shm_fetch.restype = ctypes.c_int64
    return lib


def _c_all_reduce() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C all-reduce; None without a compiler (:func:`_c_library`)."""
    lib = _c_library()
    return None if lib is None else lib.warmcap_shm_all_reduce_f32


#: the C call's statuses: a peer closed its end (+ its rank), a peer's process is gone (+ its rank),
#: the collective timeout passed
_CLOSED, _GONE, _TIMEOUT = 1000, 2000, 3000


def _status_error(status: int, rank: int | None = None) -> BaseException:
    """The exception a non-zero status of the C all-reduce stands for."""
    if status >= _TIMEOUT:
        who = "" if rank is None else f" {rank}"
        return TimeoutError(
            f"tensor-parallel rank{who} waited in shared memory for its peers past the collective timeout"
        )
    if status >= _GONE:
        return PeerGoneError(status - _GONE, "is gone (its process exited)")
    if status >= _CLOSED:
        return PeerGoneError(status - _CLOSED, "left the group")
    return RuntimeError(f"shared-memory all-reduce failed with status {status}")


def _all_reduce_cpu(
    x: torch.Tensor, words: int, rank: int, world: int, data_offset: int, data_bytes: int, timeout_ms: int
) -> None:
    fn = _c_all_reduce()
    assert fn is not None and x.dtype == torch.float32 and x.is_contiguous()
    status = c_call(fn, x.data_ptr(), x.numel(), words, rank, world, data_offset, data_bytes, timeout_ms)
    if status:
        raise _status_error(status, rank)


def _all_reduce_fake(x, words, rank, world, data_offset, data_bytes, timeout_ms):  # type: ignore[no-untyped-def]
    return None


_ALL_REDUCE = CpuOperator(
    "shm_all_reduce_",
    "(Tensor(a!) x, int words, int rank, int world, int data_offset, int data_bytes, int timeout_ms) -> ()",
    _all_reduce_cpu,
    _all_reduce_fake,
    status_error=_status_error,
)


def _post_cpu(mail: torch.Tensor, words: int, rank: int, world: int) -> None:
    lib = _c_library()
    assert lib is not None
    c_call(lib.warmcap_shm_post, words, rank, world)


def _post_fake(mail, words, rank, world):  # type: ignore[no-untyped-def]
    return None


def _fetch_cpu(mail: torch.Tensor, words: int, rank: int, world: int, peer: int, timeout_ms: int) -> None:
    lib = _c_library()
    assert lib is not None
    status = c_call(lib.warmcap_shm_fetch, words, rank, world, peer, timeout_ms)
    if status:
        raise _status_error(status, rank)


def _fetch_fake(mail, words, rank, world, peer, timeout_ms):  # type: ignore[no-untyped-def]
    return None


# The mailbox tensor is each call's argument (marked written) so that whatever orders operators by
# their tensors keeps the copy into it before the post and the reads of it after the fetch.
_POST = CpuOperator(
    "shm_post_", "(Tensor(a!) mail, int words, int rank, int world) -> ()", _post_cpu, _post_fake
)
_FETCH = CpuOperator(
    "shm_fetch_",
    "(Tensor(a!) mail, int words, int rank, int world, int peer, int timeout_ms) -> ()",
    _fetch_cpu,
    _fetch_fake,
    status_error=_status_error,
)


class ShmCommunicator:
    """All-reduce (sum) and all-gather over a :class:`~.shm_segment.Segment`; see the module docstring."""

    name = "shm"

    def __init__(self, segment: Segment) -> None:
        self.seg = segment
        self.rank = segment.rank
        self.world_size = segment.layout.world_size
        lay = segment.layout
        #: the C all-reduce's fixed arguments (None: no compiler, the Python collective serves)
        self._c_args: tuple[int, ...] | None = None
        if _c_all_reduce() is not None:
            timeout = segment.timeout_s
            self._c_args = (
                segment.address,
                self.rank,
                self.world_size,
                lay.data_offset,
                lay.data_bytes,
                -1 if math.isinf(timeout) else max(1, int(timeout * 1000)),
            )
        whole = torch.frombuffer(segment.buf, dtype=torch.uint8)
        #: [phase][rank] -> that rank's buffer as bytes
        self._bytes = [
            [whole[lay.data_at(r, p) : lay.data_at(r, p) + lay.data_bytes] for r in range(self.world_size)]
            for p in (0, 1)
        ]
        self._typed: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        #: each rank's mailbox as float32 (rank r's is written by r only)
        self._mail = [
            whole[lay.mail_at(r) : lay.mail_at(r) + lay.mail_bytes].view(torch.float32)
            for r in range(self.world_size)
        ]

    @property
    def mail_floats(self) -> int:
        """Floats one message may hold; 0: no mailbox (the C calls could not be built)."""
        return 0 if self._c_args is None else self._mail[self.rank].numel()

    def post(self, x: torch.Tensor) -> None:
        """Write ``x`` (float32, at most :attr:`mail_floats`) into this rank's mailbox and count it
        posted; the peer that reads it takes it with :meth:`fetch`."""
        assert self._c_args is not None and x.dtype == torch.float32
        if type(x) is not torch.Tensor:
            # a fake tensor (a fake pass over the forward): the operator's fake does nothing
            _POST(x, *self._c_args[:3])
            return
        mail = self._mail[self.rank][: x.numel()].view(x.shape)
        mail.copy_(x)
        words, rank, world = self._c_args[:3]
        _POST(mail, words, rank, world)

    def fetch(self, peer: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Wait for ``peer``'s next message and return it, ``shape`` float32, as a view of its
        mailbox: valid until this rank next enters a collective with ``peer`` (the peer writes its
        next message only after one). Raises :class:`~.shm_segment.PeerGoneError` when the peer
        leaves or dies, TimeoutError past the collective timeout."""
        assert self._c_args is not None
        mail = self._mail[peer][: math.prod(shape)].view(shape)
        words, rank, world = self._c_args[:3]
        _FETCH(mail, words, rank, world, peer, self._c_args[5])
        return mail

    @property
    def replayable(self) -> bool:
        """Whether its float32 all-reduce is a C call a recorded CPU graph can replay."""
        return self._c_args is not None

    def _buffers(self, dtype: torch.dtype, phase: int) -> list[torch.Tensor]:
        typed = self._typed.get(dtype)
        if typed is None:
            typed = [[b.view(dtype) for b in per_rank] for per_rank in self._bytes]
            self._typed[dtype] = typed
        return typed[phase]

    def _exchange(self, part: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``part`` (flat, at most one buffer) and return every rank's, in rank order."""
        host_sync("a shared-memory collective in Python")
        # The sequence number lives in the segment: the C all-reduce bumps the same word.
        seq = self.seg.get(self.rank, SEQ) + 1
        bufs = self._buffers(part.dtype, seq & 1)
        m = part.numel()
        bufs[self.rank][:m].copy_(part)
        self.seg.set(SEQ, seq)
        for r in range(self.world_size):
            if r != self.rank:
                self.seg.wait_at_least(r, SEQ, seq)
        return [b[:m] for b in bufs]

    def _chunk(self, x: torch.Tensor) -> int:
        return self.seg.layout.data_bytes // x.element_size()

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place, in rank order (the same bits on every rank)."""
        if (
            self._c_args is not None
            and x.dtype == torch.float32
            and x.is_contiguous()
            and x.device.type == "cpu"
        ):
            _ALL_REDUCE(x, *self._c_args)
            return x
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        per = self._chunk(x)
        for start in range(0, flat.numel(), per):
            part = flat[start : start + per]
            parts = self._exchange(part)
            torch.add(parts[0], parts[1], out=part)
            for other in parts[2:]:
                part.add_(other)
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view(x.shape))
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        x = x.contiguous()
        flat = x.view(-1)
        n = flat.numel()
        per = self._chunk(x)
        if n <= per:
            return torch.cat([p.view(x.shape) for p in self._exchange(flat)], dim=-1)
        out = [torch.empty_like(flat) for _ in range(self.world_size)]
        for start in range(0, n, per):
            for dst, src in zip(out, self._exchange(flat[start : start + per]), strict=True):
                dst[start : start + src.numel()].copy_(src)
        return torch.cat([p.view(x.shape) for p in out], dim=-1)


@dataclass(slots=True)
class LocalGroup:
    """The shared-memory planes of the ranks of one machine: the model's collectives and rank 0's
    command ring, over one segment."""

    segment: Segment
    comm: ShmCommunicator
    ring: ShmRing

    def close(self) -> None:
        self.ring.release()
        self.segment.close()


def open_local_group(
    rank: int, world_size: int, timeout_s: float, *, layout: Layout | None = None, mode: str | None = None
) -> LocalGroup | None:
    """Every rank of the (gloo) default group calls this right after joining; the group's
    shared-memory planes when all ranks can share memory, else None (every rank gets the same).
    ``layout``: the segment's sizes (tests shrink them); ``mode``: the config's ``kernel.tp_comm``."""
    mode = comm_mode(mode)
    views: list[tuple[str, str, bool]] = [("", "", False)] * world_size
    dist.all_gather_object(views, (host_key(), mode, SHM_DIR.is_dir()))
    one_host = len({v[0] for v in views}) == 1 and all(v[2] for v in views)
    modes = {v[1] for v in views}
    if "gloo" in modes and "shm" not in modes:
        return None
    if not one_host:
        if "shm" in modes:
            raise ConfigError(
                f"{ENV}=shm but the tensor-parallel ranks are not on one machine (or it has no {SHM_DIR}); "
                f"unset {ENV} to use gloo between machines"
            )
        return None
    layout = layout or Layout(world_size)
    segment: Segment | None = None
    error = ""
    name = None
    try:
        if rank == 0:
            try:
                segment = Segment.create(layout, timeout_s)
                name = segment.name
            except OSError as e:
                error = f"rank 0 could not create a shared-memory segment ({e})"
        box = [name]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
        if rank != 0 and name is not None:
            try:
                segment = Segment.attach(rank, name, layout, timeout_s)
            except OSError as e:
                error = f"rank {rank} could not map shared-memory segment {name} ({e})"
        errors = [""] * world_size
        # NOTE: also the barrier after which every rank has mapped the segment and its name can go.
        dist.all_gather_object(errors, error)
    finally:
        if rank == 0 and segment is not None:
            segment.unlink()
    problems = [e for e in errors if e]
    if problems:
        if segment is not None:
            segment.close()
        if "shm" in modes:
            raise ConfigError(f"{ENV}=shm but {problems[0]}; unset {ENV} to use gloo")
        logger.warning("tensor-parallel ranks keep gloo: %s", problems[0])
        return None
    assert segment is not None
    logger.info("tensor-parallel ranks 0..%d share memory (%s)", world_size - 1, segment.name)
    return LocalGroup(segment, ShmCommunicator(segment), ShmRing(segment))
