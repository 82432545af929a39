"""The linears of one SmolLM2-135M decode step: oneDNN-prepacked weights vs ``F.linear`` (the peer).

Per step: 30 layers of q, k, v, o, gate, up, down projections and the 49152-row LM head, on random
float32 weights of SmolLM2's shapes; rounds alternate the two, the best round of each is reported.

    .venv/bin/python benchmarks/bench_packed_linear.py --threads 1 --rows 1,4,16,64
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from warmcap.models.packed_linear import prepack_linears

HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
# (in, out) of q, k, v, o, gate, up, down
LAYER_SHAPES = [
    (HIDDEN, HIDDEN),
    (HIDDEN, KV),
    (HIDDEN, KV),
    (HIDDEN, HIDDEN),
    (HIDDEN, INTERMEDIATE),
    (HIDDEN, INTERMEDIATE),
    (INTERMEDIATE, HIDDEN),
]


def step(linears: list[nn.Linear], inputs: dict[int, torch.Tensor], layers: int) -> None:
    *layer, head = linears
    for _ in range(layers):
        for linear in layer:
            linear(inputs[linear.in_features])
    head(inputs[HIDDEN])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4,16,64", help="batch rows (tokens) to measure")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plain = [nn.Linear(i, o, bias=False) for i, o in LAYER_SHAPES] + [nn.Linear(HIDDEN, VOCAB, bias=False)]
    packed = [nn.Linear(m.in_features, m.out_features, bias=False) for m in plain]
    for p, m in zip(packed, plain, strict=True):
        p.weight = m.weight
        prepack_linears(p)
    print(
        f"SmolLM2-135M linears per decode step, {args.threads} thread(s), load average "
        f"{os.getloadavg()[0]:.1f}; best of {args.rounds} alternating rounds"
    )
    print(f"{'rows':>5}{'F.linear ms':>13}{'packed ms':>11}{'speed-up':>10}{'max |diff|':>12}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {n: torch.randn(rows, n) for n in (HIDDEN, INTERMEDIATE)}
            diff = max(
                (p(inputs[m.in_features]) - F.linear(inputs[m.in_features], m.weight)).abs().max().item()
                for p, m in zip(packed, plain, strict=True)
            )
            best = {"plain": float("inf"), "packed": float("inf")}
            for _ in range(args.rounds):
                for name, linears in (("plain", plain), ("packed", packed)):
                    t0 = time.perf_counter()
                    step(linears, inputs, LAYERS)
                    best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
            ratio = best["plain"] / best["packed"]
            print(f"{rows:>5}{best['plain']:>13.1f}{best['packed']:>11.1f}{ratio:>9.2f}x{diff:>12.1e}")


if __name__ == "__main__":
    main()
