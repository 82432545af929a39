"""The compiled GEMM (``kernels/cpu/gemm.c``) built for several ISAs: stack vector moves in its
machine code (``objdump -d``) and the time of SmolLM2-135M's linear products, against another
version of the source in the same run.

    .venv/bin/python benchmarks/bench_gemm_isa.py --against /path/to/old/gemm.c \
        --march haswell,native --layers 12 --rows 1,4,16,64 --rounds 7

Each (source, -march) pair is compiled with the package's flags for ``gemm.c`` (``build.py``);
``-march=haswell`` is the AVX2 build, which runs on any AVX-512 CPU too. A stack vector move is a
vector ``vmov*`` with an ``(%rsp)`` or ``(%rbp)`` operand: spills and reloads, plus the epilogue's
copies for partial column blocks; ``vmovaps/vmovups`` alone are the float-vector spills. Timing: one
pass is the q/k/v, o, gate/up and down products of ``--layers`` layers (each layer its own weights,
so they stream from beyond L2), at M rows, ``--threads`` threads (1 by default); the gate/up product
is the fused ``warmcap_gemm_silu_mul`` the model calls, its SiLU epilogue included (before
2026-12-05 it was timed as a plain product of 3072 columns); builds alternate within every round, and the
median of rounds is printed with each build's time over the ``--against`` build of the same
``-march``. Every build's outputs are compared bit for bit with the package build's.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

from warmcap.kernels.cpu.build import compiler, flags_of
from warmcap.kernels.cpu.gemm import BlockedWeight, padded

#: SmolLM2-135M's products per layer: (K, N, gated) of q/k/v, o, gate/up (N = both halves; gated:
#: through warmcap_gemm_silu_mul, N/2 outputs), down
SHAPES = [(576, 960, False), (576, 576, False), (576, 3072, True), (1536, 576, False)]
_STACK_MOVE = re.compile(r"\svmov\S*\s.*\(%r[sb]p\)")
_FLOAT_SPILL = re.compile(r"\svmov[au]ps\s.*\(%r[sb]p\)")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def build(source: Path, march: str, out: Path) -> ctypes.CDLL:
    cc = compiler()
    if cc is None:
        raise SystemExit("no C compiler (set CC)")
    flags = [f if f != "-march=native" else f"-march={march}" for f in flags_of("gemm.c")]
    subprocess.run([cc, *flags, f"-I{source.parent}", str(source), "-o", str(out), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def stack_moves(lib: Path) -> tuple[int, int]:
    text = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True, check=True
    )
    lines = text.stdout.splitlines()
    return sum(bool(_STACK_MOVE.search(x)) for x in lines), sum(bool(_FLOAT_SPILL.search(x)) for x in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, help="another gemm.c (its headers beside it)")
    parser.add_argument("--march", default="haswell,native")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads a product")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if shutil.which("objdump") is None:
        raise SystemExit("objdump not found (binutils)")
    tmp = Path(tempfile.mkdtemp(prefix="gemm-isa-"))
    with resources.as_file(resources.files("warmcap.kernels.cpu").joinpath("gemm.c")) as package_source:
        sources = {"package": Path(package_source)}
        if args.against is not None:
            sources = {"against": args.against, **sources}
        fns = {}
        for name, source in sources.items():
            for march in args.march.split(","):
                so = tmp / f"{name}-{march}.so"
                lib = build(source, march, so)
                for fn in (lib.warmcap_gemm, lib.warmcap_gemm_silu_mul):
                    fn.argtypes, fn.restype = (
                        [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _P, ctypes.c_int32],
                        None,
                    )
                fns[f"{name}/{march}"] = (lib.warmcap_gemm, lib.warmcap_gemm_silu_mul)
                moves, spills = stack_moves(so)
                print(
                    f"{name:8s} -march={march:15s} stack vector moves {moves:6d} (vmovaps/vmovups {spills})"
                )
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES * args.layers
    weights = [
        BlockedWeight.pack(torch.randn(n, k, generator=gen), torch.randn(n, generator=gen))
        for k, n, _ in shapes
    ]
    # each build against the --against build of the same -march (itself when there is none)
    base = {
        name: f"against/{name.split('/')[1]}" if f"against/{name.split('/')[1]}" in fns else name
        for name in fns
    }
    reference = f"package/{args.march.split(',')[-1]}"
    for m in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(m, k, generator=gen) for k, _, _ in shapes]
        scratch = torch.empty(padded(m) * max(k for k, _, _ in shapes))
        outs = {name: [torch.empty(m, n // 2 if gated else n) for _, n, gated in shapes] for name in fns}

        def run(
            name: str, m: int = m, xs: list = xs, scratch: torch.Tensor = scratch, outs: dict = outs
        ) -> None:
            for x, w, o, (_, _, gated) in zip(xs, weights, outs[name], shapes, strict=True):
                k, n = x.shape[1], o.shape[1]
                fns[name][1 if gated else 0](
                    x.data_ptr(),
                    k,
                    w.blocks.data_ptr(),
                    w.bias.data_ptr(),
                    o.data_ptr(),
                    n,
                    m,
                    k,
                    n,
                    scratch.data_ptr(),
                    args.threads,
                )

        times: dict[str, list[float]] = {name: [] for name in fns}
        for name in fns:
            run(name)
        same = {
            name: all(torch.equal(a, b) for a, b in zip(outs[name], outs[reference], strict=True))
            for name in fns
        }
        for _ in range(args.rounds):
            for name in fns:
                start = time.perf_counter()
                run(name)
                times[name].append((time.perf_counter() - start) * 1e3)
        med = {name: statistics.median(t) for name, t in times.items()}
        cells = "  ".join(
            f"{name} {med[name]:.1f} ms ({med[name] / med[base[name]]:.2f}x){'' if same[name] else ' BITS DIFFER'}"
            for name in fns
        )
        print(f"M={m:3d}: {cells}")


if __name__ == "__main__":
    main()
