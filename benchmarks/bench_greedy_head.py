"""The LM head of greedy steps: full float32 logits + ``row_argmax`` vs the screened head
(``models/greedy_head.py``), on the hidden rows the throughput workload really produces.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_greedy_head.py --threads 1 --rounds 5

Runs ``bench_throughput.py``'s workload once through warmcap (the same engine configuration),
keeping the rows every greedy step hands the head; then times both heads on each step's rows,
alternating per step, best of ``--rounds``. Prints per-step milliseconds, their ratio, how many
candidates each row keeps (mean, max) and how many the step re-scores (their union), and checks
that both heads pick the same tokens on every row.
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_throughput import DEFAULT_PROMPTS, load_prompts, prompt_ids, warmcap_llm

from warmcap.models.loader import load_tokenizer
from warmcap.models.presets import resolve_model
from warmcap.runner_v2.sampler import row_argmax
from warmcap.sampling_params import SamplingParams


class Recorder:
    """Stands in for the runner's screened head: answers with it and keeps every batch of rows."""

    def __init__(self, head) -> None:
        self.head = head
        self.batches: list[torch.Tensor] = []

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        self.batches.append(x.clone())
        return self.head.argmax(x)


def best_ms(fn, x: torch.Tensor, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    path = resolve_model(args.model)
    ids = prompt_ids(load_tokenizer(path), load_prompts(DEFAULT_PROMPTS, args.num_prompts), chat=True)
    llm = warmcap_llm(path, ids, args.max_tokens)
    runner, model = llm.engine.runner, llm.engine.model
    head = runner.greedy_head
    if head is None:
        raise SystemExit("this model/machine builds no screened greedy head (see models/greedy_head.py)")
    recorder = Recorder(head)
    runner.greedy_head = recorder
    llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))

    def full(x: torch.Tensor) -> torch.Tensor:
        return row_argmax(model.compute_logits(x))

    full_ms = screened_ms = 0.0
    per_row: list[int] = []
    unions: list[int] = []
    declined = 0
    with torch.inference_mode():
        for x in recorder.batches:
            full_ms += best_ms(full, x, args.rounds)
            screened_ms += best_ms(head.argmax, x, args.rounds)
            got = head.argmax(x)
            if got is None:
                declined += 1
                continue
            if not torch.equal(got, full(x)):
                raise SystemExit(f"screened and full argmax differ on a batch of {len(x)} rows")
            screen = head.screen(x)
            per_row += screen.per_row.tolist()
            unions.append(int(screen.ids.numel()))
    steps = len(recorder.batches)
    rows = sum(len(x) for x in recorder.batches)
    print(
        f"model {args.model}: {steps} greedy steps, {rows} rows ({args.num_prompts} prompts x "
        f"{args.max_tokens} tokens), {args.threads} thread(s), best of {args.rounds} per step"
    )
    print(f"  full logits + row_argmax: {full_ms / steps:7.3f} ms/step ({full_ms:8.1f} ms in all)")
    print(f"  screened head:            {screened_ms / steps:7.3f} ms/step ({screened_ms:8.1f} ms in all)")
    print(
        f"  full / screened: {full_ms / screened_ms:.2f}x; same tokens on every row; declined steps: {declined}"
    )
    if per_row:
        print(
            f"  candidates per row: mean {sum(per_row) / len(per_row):.2f}, max {max(per_row)}; "
            f"re-scored per step (union): mean {sum(unions) / len(unions):.1f}, max {max(unions)}"
        )
    print(f"  screen memory: {head.nbytes / 1e6:.1f} MB (bf16 copy, row norms, scratch)")


if __name__ == "__main__":
    main()
