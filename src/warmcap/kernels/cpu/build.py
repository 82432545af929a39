"""Compile a C kernel of this package once per machine into the warmcap cache, then load it.

The shared library's name is keyed by a sha256 of everything that changes the machine code: the
source and the package's headers, the flags, the compiler's version and the CPU's feature flags
(``-march=native``, or the target ``WARMCAP_CPU_ISA`` forces). Processes starting together (tensor-parallel ranks) take a file lock beside the
library (``<name>.lock``, filelock) before building: one builds, the others wait and load what it
built. A build goes to a temporary file that is renamed into place, so no process ever loads a
half-written library.

The kernels run their OpenMP loops on torch's own OpenMP runtime: each is compiled with
``-fopenmp`` but linked against the runtime torch has loaded (:func:`openmp_runtime`, with an rpath
to its folder), never the compiler's. With the compiler's ``libgomp`` linked too, a process would
run two OpenMP runtimes with two thread pools (torch's, the kernels'), each sized to every core and
each spinning after its parallel regions, on the same cores; thread settings applied to torch's
pool (``kernels/cpu/threads.py``: count, binding) would miss the kernels'. The runtime's path is part
of the library's key.

A failed compile is remembered under the same key (``<name>.failed``, holding the compiler's
message): every later process on the machine gets that failure back at once, flagged
:attr:`KernelBuildError.recorded`, instead of paying the compile again; the process that tried the
build is the one that reports it (:mod:`.policy`). Deleting the record retries.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from functools import cache
from importlib import resources
from pathlib import Path

from filelock import FileLock, Timeout

from warmcap import env
from warmcap.errors import ConfigError, WarmcapError
from warmcap.paths import cache_dir

#: ``-ffast-math`` stays out on purpose: the kernels rely on IEEE NaN/inf and an accurate ``expf``.
#: The target (``-march``) comes from :func:`isa_flags`.
COMPILE_FLAGS: tuple[str, ...] = ("-O3", "-fopenmp", "-shared", "-fPIC")

#: ``WARMCAP_CPU_ISA``: which instruction set the kernels are built for. ``native`` (default): this
#: CPU's. The others force one path, so a machine tests the code another machine would run: ``avx2``
#: (x86-64-v3: AVX2 + FMA, the narrow GEMM tiling), ``avx512`` (x86-64-v4 where the CPU has AVX-512;
#: elsewhere this CPU's instructions with the AVX-512 tiling forced, ``gemm.c``'s WARMCAP_WIDE_TILES),
#: ``baseline`` (x86-64-v2: SSE4.2, no FMA).
ISA_ENV = "WARMCAP_CPU_ISA"
ISAS = ("native", "avx2", "avx512", "baseline")


def cpu_has(flag: str) -> bool:
    """Whether this CPU reports ``flag`` in /proc/cpuinfo (``avx2``, ``avx512f``, ...)."""
    return flag in _cpu_flags().split()


#: the instruction set this process's kernels are built for, once an engine chose it (:func:`use_isa`)
_process_isa: str | None = None


def selected_isa() -> str:
    """The instruction set in force: the one an engine set (:func:`use_isa`), else the config's
    default (``WARMCAP_CPU_ISA``, else ``native``); an unknown value is refused."""
    isa = _process_isa
    if isa is None:
        isa = env.read(ISA_ENV).lower()
    if isa not in ISAS:
        raise KernelBuildError(f"{ISA_ENV}={isa!r} is not one of {', '.join(ISAS)}: unset it or pick one")
    return isa


def use_isa(isa: str) -> None:
    """Build and load this process's kernels for ``isa`` (the config's ``kernel.cpu_isa``). A
    process holds one build of each kernel (its operators are registered once), so once a kernel
    is loaded for another instruction set the request is refused with ConfigError."""
    global _process_isa
    if isa not in ISAS:
        raise ConfigError(f"cpu_isa {isa!r} is not one of {', '.join(ISAS)}: pick one")
    if _loaded and isa != selected_isa():
        raise ConfigError(
            f"cpu_isa {isa!r}: this process already loaded its CPU kernels for {selected_isa()!r}, and a "
            "process holds one build; start the engine in a new process (or give the same cpu_isa)"
        )
    _process_isa = isa


def isa_flags(isa: str) -> tuple[str, ...]:
    """The target flags of ``isa`` (one of :data:`ISAS`) on this CPU."""
    if isa == "avx2":
        return ("-march=x86-64-v3",)
    if isa == "avx512":
        return ("-march=x86-64-v4",) if cpu_has("avx512f") else ("-march=native", "-DWARMCAP_WIDE_TILES")
    if isa == "baseline":
        return ("-march=x86-64-v2",)
    return ("-march=native",)


#: flags of one source on top of :data:`COMPILE_FLAGS`
EXTRA_FLAGS: dict[str, tuple[str, ...]] = {
    # RoPE must round as torch's separate mul and add do: no fused multiply-add.
    "layer_ops.c": ("-ffp-contract=off",),
    # Every multiply-add of the GEMM is one fused instruction, in every variant of its tile.
    "gemm.c": ("-ffp-contract=fast",),
}


def flags_of(source: str) -> tuple[str, ...]:
    """Every flag ``source`` is compiled with (the target from ``WARMCAP_CPU_ISA``)."""
    return COMPILE_FLAGS + isa_flags(selected_isa()) + EXTRA_FLAGS.get(source, ())


#: the file names of OpenMP runtimes: GNU (``libgomp.so.1``, a wheel's ``libgomp-<hash>.so.1``),
#: Intel (``libiomp5.so``) and LLVM (``libomp.so``); the latter two also serve GCC's ``GOMP_*`` calls
_OPENMP_RUNTIME = re.compile(r"^lib(gomp|iomp5|omp)([-.][^/]*)?\.so(\.[0-9]+)*$")


def mapped_openmp_runtimes(maps: str = "/proc/self/maps") -> list[Path]:
    """Every OpenMP runtime library mapped into this process, one path per distinct file (device and
    inode), in the order first mapped; empty where ``maps`` cannot be read (no ``/proc``)."""
    seen: dict[tuple[str, str], Path] = {}
    try:
        with open(maps, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and _OPENMP_RUNTIME.match(Path(fields[5].strip()).name):
            seen.setdefault((fields[3], fields[4]), Path(fields[5].strip()))
    return list(seen.values())


@cache
def openmp_runtime() -> Path | None:
    """The OpenMP runtime torch runs its thread pool on, the library the kernels link against: the
    one mapped into this process once torch is loaded (preferring one inside torch's folder). None:
    torch loaded none (a build without OpenMP) or this platform has no ``/proc/self/maps``; the
    kernels then link the compiler's own runtime, the only one in the process."""
    # NOTE: the runtime is whatever importing torch mapped; import it here, the kernels need it anyway.
    import torch

    found = mapped_openmp_runtimes()
    inside = [p for p in found if Path(torch.__file__).parent in p.resolve().parents]
    return (inside or found or [None])[0]


def link_flags() -> tuple[str, ...]:
    """How a kernel is linked: against torch's OpenMP runtime (by path, found again at load time
    through an rpath to its folder), or with ``-fopenmp`` (the compiler's) when torch has none."""
    runtime = openmp_runtime()
    if runtime is None:
        return ("-shared", "-fopenmp")
    return ("-shared", str(runtime), f"-Wl,-rpath,{runtime.parent}")


_STDERR_TAIL = 2000
#: seconds one compile may take
COMPILE_TIMEOUT_S = 300
#: seconds a process waits for another's build before giving up (a compile and some slack)
LOCK_TIMEOUT_S = COMPILE_TIMEOUT_S + 60

_loaded: dict[Path, ctypes.CDLL] = {}


class KernelBuildError(WarmcapError):
    """A CPU kernel could not be compiled or loaded (no C compiler, a compile error, a bad library).

    ``recorded``: the failure is an earlier build's, read from the cache (nothing was compiled now).
    """

    def __init__(self, message: str, *, recorded: bool = False) -> None:
        super().__init__(message)
        self.recorded = recorded


def compiler() -> str | None:
    """The C compiler: ``$CC`` when set, else ``cc`` or ``gcc`` from ``PATH``."""
    return (env.read("CC") or None) or shutil.which("cc") or shutil.which("gcc")


def kernels_dir() -> Path:
    """Where built kernels are kept (under ``$WARMCAP_CACHE`` when set)."""
    return cache_dir() / "kernels"


@cache
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@cache
def _compiler_version(cc: str) -> str:
    # Cached per compiler: every backend built in a process asks (a failure is not cached).
    try:
        done = subprocess.run([cc, "-dumpfullversion"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(
            f"the C compiler {cc!r} cannot be run ({exc}); set CC to a working compiler"
        ) from exc
    if done.returncode != 0:
        raise KernelBuildError(
            f"the C compiler {cc!r} failed on -dumpfullversion (exit {done.returncode}): "
            f"{done.stderr.strip()[-_STDERR_TAIL:]}"
        )
    return done.stdout.strip()


def _headers() -> bytes:
    """The text of every header of this package (a source may include any of them)."""
    files = sorted(
        (f for f in resources.files(__package__).iterdir() if f.name.endswith(".h")), key=lambda f: f.name
    )
    return b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in files)


def library_path(source: str, cc: str) -> Path:
    """Where the library built from this package's C file ``source`` by ``cc`` lives."""
    text = resources.files(__package__).joinpath(source).read_bytes()
    digest = hashlib.sha256()
    for part in (
        text,
        _headers(),
        " ".join(flags_of(source)).encode(),
        " ".join(link_flags()).encode(),
        _compiler_version(cc).encode(),
        _cpu_flags().encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    return kernels_dir() / f"{Path(source).stem}-{digest.hexdigest()[:16]}.so"


def failure_path(library: Path) -> Path:
    """Where a failed build of ``library`` is recorded (same key, ``.failed``)."""
    return library.with_suffix(".failed")


def _compile(source: str, cc: str, target: Path) -> None:
    """Build ``source`` into ``target``; a compiler that fails or times out is recorded
    (:func:`failure_path`) before the error is raised."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=".so")
    os.close(fd)
    obj = tmp[: -len(".so")] + ".o"
    try:
        # Two steps: ``-fopenmp`` on the link line would add the compiler's libgomp beside torch's.
        with resources.as_file(resources.files(__package__).joinpath(source)) as src:
            for step in (
                [cc, *flags_of(source), "-c", str(src), "-o", obj],
                [cc, obj, *link_flags(), "-o", tmp, "-lm"],
            ):
                done = subprocess.run(step, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
                if done.returncode != 0:
                    message = (
                        f"{'compiling' if '-c' in step else 'linking'} {source} with {cc!r} failed "
                        f"(exit {done.returncode}): {done.stderr.strip()[-_STDERR_TAIL:]}"
                    )
                    _record_failure(target, message)
                    raise KernelBuildError(message)
        os.replace(tmp, target)
    except subprocess.TimeoutExpired as exc:
        message = f"compiling {source} with {cc!r} took over {COMPILE_TIMEOUT_S} s: {exc}"
        _record_failure(target, message)
        raise KernelBuildError(message) from exc
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"compiling {source} with {cc!r} failed: {exc}") from exc
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _record_failure(target: Path, message: str) -> None:
    """Write ``message`` as the failure record of ``target`` (whole or not at all)."""
    record = failure_path(target)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{record.name}-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(message)
    os.replace(tmp, record)


def _recorded_failure(target: Path) -> KernelBuildError | None:
    record = failure_path(target)
    try:
        message = record.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    return KernelBuildError(
        f"{message} (an earlier build on this machine; delete {record} to try again)", recorded=True
    )


def _build_once(source: str, cc: str, path: Path) -> None:
    """Make ``path`` exist: built here under the build lock unless another process built it or
    recorded its failure meanwhile (then that failure is raised)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path.with_suffix(".lock"), timeout=LOCK_TIMEOUT_S)
    try:
        with lock:
            if path.exists():
                return
            failed = _recorded_failure(path)
            if failed is not None:
                raise failed
            _compile(source, cc, path)
    except Timeout as exc:
        raise KernelBuildError(
            f"waited {LOCK_TIMEOUT_S} s for another process building {path.name} (lock {lock.lock_file}); "
            "delete the lock file if no warmcap process is running"
        ) from exc


def load_library(source: str) -> ctypes.CDLL:
    """The shared library of this package's C file ``source``, built first when not cached yet.

    Raises :class:`KernelBuildError` when there is no compiler or the build or load fails, or an
    earlier build with the same key failed (``recorded``).
    """
    cc = compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (looked for $CC, cc, gcc); install gcc or set CC")
    path = library_path(source, cc)
    lib = _loaded.get(path)
    if lib is not None:
        return lib
    if not path.exists():
        failed = _recorded_failure(path)
        if failed is not None:
            raise failed
        _build_once(source, cc, path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelBuildError(
            f"the built kernel {path} cannot be loaded ({exc}); delete it to rebuild"
        ) from exc
    _loaded[path] = lib
    return lib
