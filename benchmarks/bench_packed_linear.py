"""The linears of one SmolLM2-135M decode step: oneDNN-prepacked weights vs ``F.linear`` (the peer).

Per step: 30 layers of q, k, v, o, gate, up, down projections and the 49152-row LM head, on random
float32 weights of SmolLM2's shapes; rounds alternate the peers, the best round of each is reported.
``grouped`` is what the loader builds: q/k/v and gate/up packed as one GEMM each (``PackedGroup``).

    .venv/bin/python benchmarks/bench_packed_linear.py --threads 1 --rows 1,4,16,64
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from warmcap.models.packed_linear import packed_group, prepack_linears

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


class _Layer(nn.Module):
    """One layer's projections under the names the model gives them, so the loader's grouping applies."""

    packed_groups = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj, self.down_proj = (
            linears
        )

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> None:
        qkv = packed_group(self.q_proj, self.k_proj, self.v_proj)
        gate_up = packed_group(self.gate_proj, self.up_proj)
        assert qkv is not None and gate_up is not None
        qkv.product(x)
        self.o_proj(x)
        gate_up.product(x)
        self.down_proj(h)


def step(linears: list[nn.Module], inputs: dict[int, torch.Tensor], layers: int) -> None:
    *layer, head = linears
    for _ in range(layers):
        for linear in layer:
            if isinstance(linear, _Layer):
                linear(inputs[HIDDEN], inputs[INTERMEDIATE])
            else:
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
    copies = [nn.Linear(m.in_features, m.out_features, bias=False) for m in plain]
    for c, m in zip(copies, plain, strict=True):
        c.weight = m.weight
    layer = _Layer(copies[:-1])
    prepack_linears(layer)
    prepack_linears(copies[-1])
    grouped: list[nn.Module] = [layer, copies[-1]]
    print(
        f"SmolLM2-135M linears per decode step, {args.threads} thread(s), load average "
        f"{os.getloadavg()[0]:.1f}; best of {args.rounds} alternating rounds"
    )
    print(
        f"{'rows':>5}{'F.linear ms':>13}{'packed ms':>11}{'speed-up':>10}{'max |diff|':>12}"
        f"{'grouped ms':>12}{'vs packed':>11}"
    )
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {n: torch.randn(rows, n) for n in (HIDDEN, INTERMEDIATE)}
            diff = max(
                (p(inputs[m.in_features]) - F.linear(inputs[m.in_features], m.weight)).abs().max().item()
                for p, m in zip(packed, plain, strict=True)
            )
            best = {"plain": float("inf"), "packed": float("inf"), "grouped": float("inf")}
            for _ in range(args.rounds):
                for name, linears in (("plain", plain), ("packed", packed), ("grouped", grouped)):
                    t0 = time.perf_counter()
                    step(linears, inputs, LAYERS)
                    best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
            ratio = best["plain"] / best["packed"]
            print(
                f"{rows:>5}{best['plain']:>13.1f}{best['packed']:>11.1f}{ratio:>9.2f}x{diff:>12.1e}"
                f"{best['grouped']:>12.1f}{best['packed'] / best['grouped']:>10.2f}x"
            )


if __name__ == "__main__":
    main()
