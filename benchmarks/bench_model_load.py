"""Model load time (``warmcap.models.loader.load_model``), this tree against another, in one run.

Each sample is a fresh interpreter with ``PYTHONPATH`` set to one tree's ``src``: it imports the
loader (not timed), then times ``--loads`` loads of the preset: the first (the model class's module
is imported, the C layer ops are loaded, the weights' pages are mapped) and the fastest of the rest
(the loader's own work; the minimum, since other processes on a shared machine only ever add time).
The trees alternate sample by sample so both see the same machine load; the same preset files serve
both (the preset cache is shared). ``--weights-only`` times the model's ``load_weights`` loop alone.

    .venv/bin/python benchmarks/bench_model_load.py --peer /work/main/src \\
        --models smollm2-135m tiny-llama tiny-deepseek-v3 tiny-hybrid --rounds 5 --loads 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

THIS_SRC = Path(__file__).resolve().parents[1] / "src"

_SAMPLE = """
import json, sys, time
import torch
from warmcap.models.loader import load_model
from warmcap.models.presets import resolve_model_path
path = resolve_model_path(sys.argv[1])
times = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter()
    load_model(path)
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""

#: ``--weights-only``: the model's ``load_weights`` alone, over tensors already in memory (copied, not
#: adopted), so the loop's own cost shows without the file reads and packing around it
_WEIGHTS_ONLY = """
import json, sys, time
import torch
from safetensors.torch import load_file
from warmcap.models.loader import load_hf_config, weight_files
from warmcap.models.presets import resolve_model_path
from warmcap.models.registry import model_class
path = resolve_model_path(sys.argv[1])
config = load_hf_config(path)
with torch.device("meta"):
    model = model_class(config.architectures[0])(config)
model.to_empty(device="cpu")
model.tie_weights()
state = {}
for file in weight_files(path):
    state.update(load_file(str(file)))
items = list(state.items())
times = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter()
    model.load_weights(items)
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""


def sample(src: Path, model: str, loads: int, code: str = _SAMPLE) -> tuple[float, float]:
    """(first load, fastest later load) in seconds, in a fresh interpreter on tree ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, model, str(loads)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    times = json.loads(out.stdout.strip().splitlines()[-1])
    return times[0], min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", type=Path, required=True, help="the other tree's src/ directory")
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "tiny-llama"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loads", type=int, default=6, help="loads per process (at least 2)")
    parser.add_argument("--weights-only", action="store_true", help="time model.load_weights alone")
    args = parser.parse_args()
    code = _WEIGHTS_ONLY if args.weights_only else _SAMPLE
    trees = {"this": THIS_SRC, "peer": args.peer.resolve()}
    for model in args.models:
        sample(THIS_SRC, model, 2)  # builds the preset if it is not cached yet; not counted
        got: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
        for r in range(args.rounds):
            # Alternate which tree goes first, so neither always follows the other's page cache.
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                got[name].append(sample(trees[name], model, args.loads, code))
        print(
            f"{model}: median over {args.rounds} fresh processes of the first load and of the fastest later one (ms)"
        )
        medians: dict[str, tuple[float, float]] = {}
        for name, runs in got.items():
            first = statistics.median(t[0] for t in runs) * 1e3
            later = statistics.median(t[1] for t in runs) * 1e3
            medians[name] = (first, later)
            every = " ".join(f"{t[0] * 1e3:.1f}/{t[1] * 1e3:.2f}" for t in runs)
            print(f"  {name:5s} first {first:8.2f}  later {later:8.2f}   (first/later each: {every})")
        (f_this, l_this), (f_peer, l_peer) = medians["this"], medians["peer"]
        print(f"  ratio this/peer: first {f_this / f_peer:.3f}  later {l_this / l_peer:.3f}")


if __name__ == "__main__":
    main()
