"""One attention layer on CPU: the compiled paged kernel vs gather + SDPA, on the same step.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_cpu_attention.py --threads 1 \
        [--rows 16] [--keys 110] [--query-lens 1,2,4,8,16,32] [--heads 9 --kv-heads 3 --head-dim 64] \
        [--layers 30]

Each row has ``--keys`` keys after the step (its last ``query_len`` written by the step) in shuffled
16-token pages. gather + SDPA is ``TorchPagedAttention.forward`` under ``WARMCAP_CPU_ATTENTION=torch``
with the step's plan already derived, as every layer after a step's first finds it; the kernel is
called directly as the engine calls it (it writes the step's K/V itself), at every query length
(past ``MAX_QUERY_LEN`` too). ``--layers N`` gives each of N layers its own cache and cycles over
them, so a cache is as cold as a model's is. The two paths alternate batch by batch. Prints
microseconds per call (median and best of ``--repeats`` timed batches) for each query length: where
the kernel stops winning sets ``MAX_QUERY_LEN`` in ``kernels/cpu/paged_attention.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from warmcap.contracts import AttentionMetadata
from warmcap.kernels.cpu.paged_attention import KernelInputs, load_paged_attention
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention, sink_slots

BLOCK_SIZE = 16


def step(rows: int, keys: int, qlen: int, hq: int, hkv: int, d: int, gen: torch.Generator):
    cols = -(-keys // BLOCK_SIZE)
    num_blocks = rows * cols + 1
    cache = torch.randn(2, num_blocks + 1, BLOCK_SIZE, hkv, d, generator=gen)
    table = (torch.randperm(num_blocks - 1, generator=gen)[: rows * cols] + 1).view(rows, cols).int()
    qsl = torch.arange(rows + 1, dtype=torch.int32) * qlen
    seq = torch.full((rows,), keys, dtype=torch.int32)
    pos = torch.arange(keys - qlen, keys)
    slots = (table[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    meta = AttentionMetadata(
        num_tokens=rows * qlen,
        num_reqs=rows,
        query_start_loc=qsl,
        seq_lens=seq,
        block_table=table,
        slot_mapping=slots,
        max_query_len=qlen,
        max_seq_len=keys,
        block_size=BLOCK_SIZE,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
    )
    q = torch.randn(rows * qlen, hq, d, generator=gen)
    k = torch.randn(rows * qlen, hkv, d, generator=gen)
    v = torch.randn(rows * qlen, hkv, d, generator=gen)
    return q, k, v, cache, meta


def time_us(calls_of: dict[str, Callable[[], object]], *, calls: int, repeats: int) -> dict[str, list[float]]:
    """Microseconds per call of each callable, ``repeats`` batches of ``calls``, alternating the
    callables batch by batch so a burst of load on a shared machine hits all of them."""
    samples: dict[str, list[float]] = {name: [] for name in calls_of}
    for call in calls_of.values():
        call()
    for _ in range(repeats):
        for name, call in calls_of.items():
            start = time.perf_counter()
            for _ in range(calls):
                call()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--keys", type=int, default=110)
    parser.add_argument("--query-lens", default="1,2,4,8,16,32")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--layers",
        type=int,
        default=1,
        help="cycle over this many layers' caches, as a model does (30 for SmolLM2: each cache is cold "
        "by the time its layer comes round again); 1 keeps one warm cache",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["WARMCAP_CPU_ATTENTION"] = "kernel"
    kernel = load_paged_attention()
    assert kernel is not None
    os.environ["WARMCAP_CPU_ATTENTION"] = "torch"
    eager = TorchPagedAttention("cpu")
    scale = args.head_dim**-0.5
    print(
        f"{args.rows} rows x {args.keys} keys, {args.heads} q heads / {args.kv_heads} kv heads, D {args.head_dim}, "
        f"{args.threads} thread(s), load {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    for qlen in (int(x) for x in args.query_lens.split(",")):
        gen = torch.Generator().manual_seed(qlen)
        layers = []
        for _ in range(args.layers):
            q, k, v, cache, meta = step(
                args.rows, max(args.keys, qlen), qlen, args.heads, args.kv_heads, args.head_dim, gen
            )
            layers.append((q, k, v, cache, meta, sink_slots(meta.slot_mapping, cache), KernelInputs.of(meta)))
        turn = {"sdpa": 0, "kernel": 0}

        def sdpa() -> None:
            q, k, v, cache, meta, _, _ = layers[turn["sdpa"] % len(layers)]  # noqa: B023 (this iteration's)
            turn["sdpa"] += 1  # noqa: B023
            eager.forward(q, k, v, cache, meta, scale=scale)

        def paged() -> None:
            # As the engine calls it: the kernel writes the step's K/V, then attends.
            q, k, v, cache, _, slots, inputs = layers[turn["kernel"] % len(layers)]  # noqa: B023
            turn["kernel"] += 1  # noqa: B023
            kernel(q, cache, inputs, scale=scale, window=None, new_kv=(k, v, slots))

        samples = time_us({"sdpa": sdpa, "kernel": paged}, calls=args.calls, repeats=args.repeats)
        med = {name: statistics.median(x) for name, x in samples.items()}
        best = {name: min(x) for name, x in samples.items()}
        print(
            f"query_len {qlen:3d}: gather+SDPA {med['sdpa']:8.1f} us  kernel {med['kernel']:8.1f} us  "
            f"({med['sdpa'] / med['kernel']:.2f}x median; best {best['sdpa']:.1f} vs {best['kernel']:.1f} us, "
            f"{best['sdpa'] / best['kernel']:.2f}x)"
        )


if __name__ == "__main__":
    main()
