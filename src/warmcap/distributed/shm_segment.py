"""One shared-memory segment that the tensor-parallel ranks of one machine all map: where their
collectives (:mod:`.shm_comm`) and rank 0's command ring (:mod:`.shm_ring`) live, and how a rank
waits on a peer there without hanging on a dead one.

Layout (little words are int64, each rank's own words on their own cache lines so a rank bumping
its counter never invalidates the line another rank is bumping):

- line 0: the layout (world size, data capacity, ring slots and slot size), to check on attach;
- one line per rank: its pid, its collective sequence number, its closed flag (set when it leaves,
  on any path, so peers stop waiting at once), and its ring count (messages read; rank 0: sent);
- the data area: per rank two buffers (even and odd collective) of ``data_bytes`` each;
- the ring area: ``ring_slots`` slots of ``ring_slot_bytes``;
- the mail area: per rank one mailbox of ``mail_bytes``, which that rank fills for one peer that
  reads it in place (a helper rank's K/V projections for a rank holding more heads:
  ``models/llama.py`` :class:`KVOffload`); MAIL counts what the owner posted, TAKEN what the
  reader took.

Lifetime: rank 0 creates ``/dev/shm/warmcap-<pid>-<hex>``; every rank maps it; once every rank has
mapped it (a gloo barrier) the name is unlinked (:func:`open_local_group`). From then on the
segment has no name: it lives exactly as long as some rank maps it, so no exit path (a rank killed
with SIGKILL included) can leave it behind. Only a death inside the few milliseconds between create
and unlink could, and rank 0 removes the name in its ``finally`` there.

Waiting (:meth:`Segment.wait_at_least`): a spin, then the kernel: a futex wait on the
awaited word (Linux), which the writer wakes when it sees a waiter's flag. The spin adapts (up to
:data:`SPIN_MAX_S`, while most recent waits ended within that): on a quiet
machine, where each rank has its core, the ranks' waits between collectives are short and a rank
woken from a futex (tens of microseconds later) would make its peer wait at the next collective;
on a busy one the peer is often descheduled, spins fail, and the spin shrinks to nothing. On a machine with as
many busy threads as cores a long spin would steal the very core the awaited peer needs, and a
sleeper woken by the kernel is scheduled ahead of tasks that spin or ``sched_yield`` (with eight
yields before the sleep, ``benchmarks/bench_tp.py`` measured the all-reduces 1.5x slower than
gloo's blocking reads at load 30 on 2 cores). Without a futex (another
OS or CPU) the wait sleeps in growing steps instead. Every :data:`CHECK_S` the wait also checks the
peers: one whose closed flag is set or whose process is gone (or a zombie) ends the wait with
:class:`PeerGoneError`, and a deadline ends it with :class:`TimeoutError`.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

#: where POSIX shared memory lives on Linux; no such directory: the ranks keep gloo
SHM_DIR = Path("/dev/shm")
#: every segment's name starts with this, then rank 0's pid (tests look for leftovers by it)
PREFIX = "warmcap-"
#: bytes per header line: two x86 cache lines (the adjacent-line prefetcher pairs them), one on
#: Apple/ARM parts with 128-byte lines
LINE = 128
WORDS_PER_LINE = LINE // 8
#: per-rank words within its line: its pid, its collective count, its closed flag, for the command
#: ring the messages it has read (workers) or sent (rank 0), the word it sleeps on (index + 1), and
#: for the mailboxes the messages it has posted in its own and taken from its peer's
PID, SEQ, CLOSED, READ, SENT, SLEEPING, MAIL, TAKEN = 0, 1, 2, 3, 4, 5, 6, 7
#: each rank's collective buffer (x2, even and odd): a decode step's all-reduce is hidden x tokens
#: floats (SmolLM2, 8 tokens: 18 KiB); a larger tensor goes through in chunks of this
DATA_BYTES = 4 << 20
#: command ring: slots and bytes per slot (a decode step's pickled SchedulerOutput is under 1 KiB;
#: a larger command falls back to the gloo broadcast)
RING_SLOTS = 8
RING_SLOT_BYTES = 256 << 10
#: each rank's mailbox: SmolLM2's offloaded K/V (2 KV heads x 64 x 2 floats a token) for 4096 tokens
MAIL_BYTES = 4 << 20
#: how often a wait checks its peers and its deadline
CHECK_S = 0.01
#: waits first spin this many polls (a few microseconds), then for an adaptive time (below), then
#: sleep in the kernel
SPIN_POLLS = 64
#: the adaptive spin: a wait that outlasts the polls spins up to this long (a decode step's longest
#: wait between two collectives on a quiet machine, one rank's extra attention heads, is a few
#: hundred microseconds) while most recent such waits ended within it (a running share, each wait
#: weighing SPIN_SHARE_WEIGHT); when most did not (the peer is far behind or descheduled) it goes
#: straight to the kernel
SPIN_MAX_S = 500e-6
SPIN_SHARE_WEIGHT = 1 / 8
#: the longest sleep step where no futex is available
MAX_SLEEP_S = 0.002


class PeerGoneError(RuntimeError):
    """A rank waited on in shared memory left the group (closed its end) or its process is gone."""

    def __init__(self, rank: int, what: str) -> None:
        super().__init__(f"tensor-parallel rank {rank} {what}")
        self.rank = rank


def host_key() -> str:
    """What ranks must share to share memory: the host (name and boot), and the pid namespace
    (the pids in the header are checked for liveness)."""
    boot = ""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    return f"{socket.gethostname()}|{boot}|{pid_ns}"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: a zombie (a dead child not yet reaped, as a killed spawned
    worker is until rank 0 polls it) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    # The state follows the command name, which is in parentheses and may itself hold any byte.
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


#: futex(2)'s syscall number per CPU (Linux); elsewhere waits sleep in steps
_FUTEX_NR = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98, "ppc64le": 221}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Futex:
    """futex(2) on a word of a shared mapping (no FUTEX_PRIVATE flag: the waker is another process)."""

    def __init__(self, nr: int) -> None:
        self.nr = nr
        self.call = ctypes.CDLL(None, use_errno=True).syscall
        self.call.restype = ctypes.c_long

    @classmethod
    def load(cls) -> _Futex | None:
        nr = _FUTEX_NR.get(platform.machine().lower()) if sys.platform == "linux" else None
        if nr is None:
            return None
        try:
            return cls(nr)
        except (OSError, AttributeError):
            return None

    def wait(self, addr: int, seen: int, timeout_s: float) -> None:
        """Sleep while the 32-bit word at ``addr`` still holds ``seen`` (its low half), at most
        ``timeout_s``; returns early on a wake, a changed word or a signal."""
        low = seen & 0xFFFFFFFF
        ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
        self.call(
            ctypes.c_long(self.nr),
            ctypes.c_void_p(addr),
            ctypes.c_int(_FUTEX_WAIT),
            ctypes.c_int(low - (1 << 32) if low >= 1 << 31 else low),
            ctypes.byref(ts),
            None,
            ctypes.c_int(0),
        )

    def wake(self, addr: int) -> None:
        self.call(
            ctypes.c_long(self.nr), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE), ctypes.c_int(2**31 - 1),
            None, None, ctypes.c_int(0),
        )  # fmt: skip


_futex = _Futex.load()


@dataclass(frozen=True, slots=True)
class Layout:
    """Where everything lies in a segment of ``world_size`` ranks."""

    world_size: int
    data_bytes: int = DATA_BYTES
    ring_slots: int = RING_SLOTS
    ring_slot_bytes: int = RING_SLOT_BYTES
    mail_bytes: int = MAIL_BYTES

    @property
    def header_bytes(self) -> int:
        return LINE * (1 + self.world_size)

    @property
    def data_offset(self) -> int:
        return _align(self.header_bytes, 4096)

    def data_at(self, rank: int, phase: int) -> int:
        return self.data_offset + (2 * rank + phase) * self.data_bytes

    @property
    def ring_offset(self) -> int:
        return self.data_offset + 2 * self.world_size * self.data_bytes

    def slot_at(self, index: int) -> int:
        return self.ring_offset + index * self.ring_slot_bytes

    @property
    def mail_offset(self) -> int:
        return self.ring_offset + self.ring_slots * self.ring_slot_bytes

    def mail_at(self, rank: int) -> int:
        return self.mail_offset + rank * self.mail_bytes

    @property
    def total_bytes(self) -> int:
        return self.mail_offset + self.world_size * self.mail_bytes

    def word(self, rank: int, field: int) -> int:
        """Index (in int64 words) of ``field`` of ``rank``'s header line."""
        return (1 + rank) * WORDS_PER_LINE + field

    def describe(self) -> tuple[int, int, int, int, int]:
        return (self.world_size, self.data_bytes, self.ring_slots, self.ring_slot_bytes, self.mail_bytes)


def _align(n: int, to: int) -> int:
    return n + (-n) % to


class Segment:
    """This rank's mapping of the group's segment (see the module docstring)."""

    def __init__(self, rank: int, layout: Layout, buf: mmap.mmap, name: str, timeout_s: float) -> None:
        self.rank = rank
        self.layout = layout
        self.buf = buf
        self.name = name
        self.timeout_s = timeout_s
        self._raw = memoryview(buf)
        #: the segment as int64 words (the header's are used): aligned 8-byte loads and stores
        self.words = self._raw.cast("q")
        # NOTE: a lock acquire/release is a full memory barrier on every platform CPython runs on;
        # it orders a rank's data writes before its counter write (and a reader's counter read
        # before its data reads) where the CPU would not (ARM), at ~0.1 us.
        self._fence_lock = threading.Lock()
        self._closed = False
        #: the adaptive spin (see :data:`SPIN_MAX_S`): the recent share of waits that ended within
        #: it, and whether waits spin now
        self._short_share = 1.0
        self._spinning = True
        # The futex address of a word: its low 32 bits (the word's first half on little-endian CPUs).
        self._anchor = ctypes.c_char.from_buffer(buf)
        self._low_half = 0 if sys.byteorder == "little" else 4

    # ---- creating and attaching ------------------------------------------------------------------

    @classmethod
    def create(cls, layout: Layout, timeout_s: float) -> Segment:
        """Rank 0: a new, zeroed segment under a fresh name."""
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, layout.total_bytes)
            buf = mmap.mmap(fd, layout.total_bytes)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        seg = cls(0, layout, buf, name, timeout_s)
        head = seg.words
        for i, v in enumerate(layout.describe()):
            head[i] = v
        seg._register()
        return seg

    @classmethod
    def attach(cls, rank: int, name: str, layout: Layout, timeout_s: float) -> Segment:
        """A worker rank: map rank 0's segment ``name``, which must have ``layout``."""
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != layout.total_bytes:
                raise OSError(f"shared-memory segment {name} has the wrong size")
            buf = mmap.mmap(fd, layout.total_bytes)
        finally:
            os.close(fd)
        seg = cls(rank, layout, buf, name, timeout_s)
        if tuple(seg.words[:5]) != layout.describe():
            seg.close()
            raise OSError(f"shared-memory segment {name} has another layout")
        seg._register()
        return seg

    @property
    def address(self) -> int:
        """Where this rank maps the segment (its first byte), for C code that reads it directly."""
        return ctypes.addressof(self._anchor)

    def _register(self) -> None:
        self.words[self.layout.word(self.rank, PID)] = os.getpid()

    def unlink(self) -> None:
        """Remove the segment's name (the mappings stay valid); idempotent."""
        (SHM_DIR / self.name).unlink(missing_ok=True)

    def close(self) -> None:
        """Mark this rank gone for its peers and drop the mapping; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.words[self.layout.word(self.rank, CLOSED)] = 1
        except ValueError:
            return
        del self._anchor
        self.words.release()
        self._raw.release()
        # NOTE: tensors viewing the mapping (the collectives' buffers) keep it exported until they
        # are freed; the mapping then goes with the last of them.
        with contextlib.suppress(BufferError):
            self.buf.close()

    # ---- the header --------------------------------------------------------------------------------

    def fence(self) -> None:
        with self._fence_lock:
            pass

    def get(self, rank: int, field: int) -> int:
        return self.words[self.layout.word(rank, field)]

    def set(self, field: int, value: int) -> None:
        """Publish this rank's ``field`` (after a fence: what it wrote before is visible first) and
        wake the peers asleep on it."""
        self.fence()
        words = self.words
        index = self.layout.word(self.rank, field)
        words[index] = value
        if _futex is None:
            return
        # NOTE: the fence orders the store above before the loads below; a waiter orders its
        # SLEEPING store before its load of the word the same way, so either it sees the value or
        # this sees its flag.
        self.fence()
        lay = self.layout
        for r in range(lay.world_size):
            if r != self.rank and words[lay.word(r, SLEEPING)] == index + 1:
                _futex.wake(self._addr(index))
                return

    def _addr(self, index: int) -> int:
        return ctypes.addressof(self._anchor) + 8 * index + self._low_half

    def wait_at_least(self, rank: int, field: int, target: int, *, timeout_s: float | None = None) -> None:
        """Wait until ``rank``'s ``field`` reaches ``target``; then what ``rank`` wrote before it is
        visible here. Raises :class:`PeerGoneError` when a peer leaves or dies, :class:`TimeoutError`
        after ``timeout_s`` (default: the group's collective timeout)."""
        words = self.words
        index = self.layout.word(rank, field)
        if words[index] >= target:
            self.fence()
            return
        for _ in range(SPIN_POLLS):
            if words[index] >= target:
                self.fence()
                return
        clock = time.perf_counter
        start = clock()
        if self._spinning:
            end = start + SPIN_MAX_S
            while clock() < end:
                if words[index] >= target:
                    self._record_wait(short=True)
                    self.fence()
                    return
        self._wait_slow(index, target, self.timeout_s if timeout_s is None else timeout_s)
        self._record_wait(short=clock() - start < SPIN_MAX_S)

    def _record_wait(self, *, short: bool) -> None:
        """Fold a wait that outlasted the polls into the share of short ones; spin while most are."""
        self._short_share += (float(short) - self._short_share) * SPIN_SHARE_WEIGHT
        self._spinning = self._short_share >= 0.5

    def wait_idle(self, rank: int, field: int, target: int) -> None:
        """:meth:`wait_at_least` without a deadline: a worker waiting for the next command waits as
        long as the engine is idle, and only a peer's death ends it."""
        self.wait_at_least(rank, field, target, timeout_s=float("inf"))

    def _wait_slow(self, index: int, target: int, timeout_s: float) -> None:
        words = self.words
        start = time.monotonic()
        check_at = start + CHECK_S
        flag = self.layout.word(self.rank, SLEEPING)
        addr = self._addr(index)
        try:
            while True:
                if _futex is not None:
                    words[flag] = index + 1
                    self.fence()
                seen = words[index]
                if seen >= target:
                    break
                if _futex is not None:
                    _futex.wait(addr, seen, CHECK_S)
                else:
                    # Sleeps grow with the wait: short while a peer is merely behind, longer when idle.
                    time.sleep(min(MAX_SLEEP_S, (time.monotonic() - start) / 16 + 1e-5))
                if words[index] >= target:
                    break
                now = time.monotonic()
                if now >= check_at:
                    self.check_peers()
                    if now - start > timeout_s:
                        raise TimeoutError(
                            f"tensor-parallel rank {self.rank} waited {now - start:.1f} s in shared "
                            "memory for its peers (the collective timeout)"
                        )
                    check_at = now + CHECK_S
        finally:
            words[flag] = 0
        self.fence()

    def check_peers(self) -> None:
        """Raise :class:`PeerGoneError` for the first peer that closed its end or whose process is gone."""
        for rank in range(self.layout.world_size):
            if rank == self.rank:
                continue
            if self.get(rank, CLOSED):
                raise PeerGoneError(rank, "left the group")
            pid = self.get(rank, PID)
            if pid and not pid_alive(pid):
                raise PeerGoneError(rank, f"is gone (its process {pid} exited)")
