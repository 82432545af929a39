"""Compile a C kernel of this package once per machine into the warmcap cache, then load it.

The shared library's name is keyed by a sha256 of everything that changes the machine code: the
source and the package's headers, the flags, the compiler's version and the CPU's feature flags
(``-march=native``). A build goes to a temporary file that is renamed into place, so processes
starting together each either find a finished library or build their own copy; none loads a
half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from importlib import resources
from pathlib import Path

from warmcap.errors import WarmcapError
from warmcap.paths import cache_dir

#: ``-ffast-math`` stays out on purpose: the kernels rely on IEEE NaN/inf and an accurate ``expf``.
COMPILE_FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
#: flags of one source on top of :data:`COMPILE_FLAGS`
EXTRA_FLAGS: dict[str, tuple[str, ...]] = {
    # RoPE must round as torch's separate mul and add do: no fused multiply-add.
    "layer_ops.c": ("-ffp-contract=off",),
    # Every multiply-add of the GEMM is one fused instruction, in every variant of its tile.
    "gemm.c": ("-ffp-contract=fast",),
}


def flags_of(source: str) -> tuple[str, ...]:
    """Every flag ``source`` is compiled with."""
    return COMPILE_FLAGS + EXTRA_FLAGS.get(source, ())


_STDERR_TAIL = 2000

_loaded: dict[Path, ctypes.CDLL] = {}


class KernelBuildError(WarmcapError):
    """A CPU kernel could not be compiled or loaded (no C compiler, a compile error, a bad library)."""


def compiler() -> str | None:
    """The C compiler: ``$CC`` when set, else ``cc`` or ``gcc`` from ``PATH``."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


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
        _compiler_version(cc).encode(),
        _cpu_flags().encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    return kernels_dir() / f"{Path(source).stem}-{digest.hexdigest()[:16]}.so"


def _compile(source: str, cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=".so")
    os.close(fd)
    try:
        with resources.as_file(resources.files(__package__).joinpath(source)) as src:
            done = subprocess.run(
                [cc, *flags_of(source), str(src), "-o", tmp, "-lm"],
                capture_output=True,
                text=True,
                timeout=300,
            )
        if done.returncode != 0:
            raise KernelBuildError(
                f"compiling {source} with {cc!r} failed (exit {done.returncode}): "
                f"{done.stderr.strip()[-_STDERR_TAIL:]}"
            )
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"compiling {source} with {cc!r} failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library(source: str) -> ctypes.CDLL:
    """The shared library of this package's C file ``source``, built first when not cached yet.

    Raises :class:`KernelBuildError` when there is no compiler or the build or load fails.
    """
    cc = compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (looked for $CC, cc, gcc); install gcc or set CC")
    path = library_path(source, cc)
    lib = _loaded.get(path)
    if lib is not None:
        return lib
    if not path.exists():
        _compile(source, cc, path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelBuildError(
            f"the built kernel {path} cannot be loaded ({exc}); delete it to rebuild"
        ) from exc
    _loaded[path] = lib
    return lib
