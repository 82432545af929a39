"""GPU decode benchmark: warmcap with CUDA graphs vs warmcap eager vs transformers ``generate``
(dynamic cache) vs transformers with a static cache and ``torch.compile``, same token ids, same
weights, at several batch sizes.

    HF_HUB_OFFLINE=1 python benchmarks/bench_gpu.py --model smollm2-135m --dtype bfloat16 \
        --batches 1,8,64 --max-tokens 128 [--out results.json]

Each peer generates ``--max-tokens`` tokens greedily (``ignore_eos``: every row runs to the end)
for a batch of the shipped prompts (``benchmarks/data/bench_prompts.jsonl``, through the chat
template, cycled when the batch is larger than the file). Per peer and batch it prints:

- **ms a step**: ``(T(n) - T(1)) / (n - 1)`` for a run of n tokens and a run of one, so the prompt's
  prefill drops out; **tok/s**: ``batch * n / T(n)`` (prefill included);
- **kernels a step** (CUDA): CUDA kernels the torch profiler sees in a run of n tokens less a run
  of one, over ``n - 1``;
- **tokens**: rows identical to warmcap-graphs' (bf16 peers may part after some tokens: the
  first differing position is printed; it is reported, not failed).

Needs torch, triton, transformers and warmcap (docs/gpu-validation.md: bringing the wheels to the
GPU machine). ``--smoke`` runs a tiny preset on CPU in seconds (tests run it): warmcap's ``static``
graph backend stands in for CUDA graphs and the static-cache peer runs without ``torch.compile``
(transformers compiles only on accelerators); its numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
PROMPTS_FILE = HERE / "data" / "bench_prompts.jsonl"
PEERS = ("warmcap_graphs", "warmcap_eager", "hf_generate", "hf_static_compile")

#: generate(batch of token ids, number of new tokens) -> new token ids per row
Generate = Callable[[list[list[int]], int], list[list[int]]]


def batch_prompts(tokenizer: Any, batch: int, *, chat: bool) -> list[list[int]]:
    """``batch`` prompts' token ids: the workload file in order, cycled."""
    rows = [json.loads(line)["prompt"] for line in PROMPTS_FILE.read_text().splitlines() if line.strip()]
    texts = [rows[i % len(rows)] for i in range(batch)]
    if tokenizer is None:
        return [[3 + (7 * i + j) % 90 for j in range(4 + i % 5)] for i in range(batch)]
    if not chat or getattr(tokenizer, "chat_template", None) is None:
        return [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    out = []
    for t in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") or hasattr(ids, "input_ids") else ids))
    return out


def warmcap_peer(model: str, dtype: str, device: str, batch: int, max_len: int, *, eager: bool) -> Generate:
    from warmcap.llm import LLM
    from warmcap.sampling_params import SamplingParams

    llm = LLM(
        model,
        device=device,
        dtype=dtype,
        max_num_seqs=batch,
        max_num_batched_tokens=max(512, batch * max_len),
        max_model_len=max_len,
        enforce_eager=eager,
    )

    def generate(ids: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.engine.kv_cache_manager.reset_prefix_cache()
        return [o.token_ids for o in llm.generate(ids, params)]

    return generate


def hf_peer(path: Path, dtype: str, device: str, *, static: bool, compile_: bool) -> Generate:
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype).to(device).eval()
    extra: dict[str, Any] = {}
    if static:
        extra["cache_implementation"] = "static"
        if compile_:
            from transformers import CompileConfig

            # transformers compiles the forward itself with a static cache on an accelerator.
            extra["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
        else:
            extra["disable_compile"] = True

    def generate(ids: list[list[int]], n: int) -> list[list[int]]:
        width = max(len(p) for p in ids)
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in ids], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
                **extra,
            )
        return out[:, width:].tolist()

    return generate


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(generate: Generate, ids: list[list[int]], n: int, device: str) -> tuple[float, list[list[int]]]:
    _sync(device)
    t0 = time.perf_counter()
    out = generate(ids, n)
    _sync(device)
    return time.perf_counter() - t0, out


def cuda_kernels(generate: Generate, ids: list[list[int]], n: int) -> int:
    """CUDA kernels launched by one generation of ``n`` tokens (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate(ids, n)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two rows differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure(
    name: str, generate: Generate, ids: list[list[int]], n: int, device: str, rounds: int
) -> dict[str, Any]:
    generate(ids[:1], 2)  # warm: compile, capture, allocator
    generate(ids, 2)
    full, one = float("inf"), float("inf")
    tokens: list[list[int]] = []
    for _ in range(rounds):
        t, tokens = timed(generate, ids, n, device)
        full = min(full, t)
        one = min(one, timed(generate, ids, 1, device)[0])
    row: dict[str, Any] = {
        "peer": name,
        "batch": len(ids),
        "max_tokens": n,
        "seconds": full,
        "tok_s": len(ids) * n / full,
        "ms_per_step": (full - one) / (n - 1) * 1e3 if n > 1 else None,
        "kernels_per_step": None,
        "tokens": tokens,
    }
    if device.startswith("cuda") and n > 1:
        row["kernels_per_step"] = (cuda_kernels(generate, ids, n) - cuda_kernels(generate, ids, 1)) / (n - 1)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--out", help="also write the rows (tokens left out) as JSON here")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny-llama float32 on CPU, batches 1,2, 4 tokens, one round"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.dtype, args.device, args.batches, args.max_tokens, args.rounds = (
            "tiny-llama",
            "float32",
            "cpu",
            "1,2",
            4,
            1,
        )
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        parser.error(f"unknown peer(s) {unknown}: use some of {', '.join(PEERS)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu: CUDA is not available here; run it on a CUDA machine, or --smoke on CPU")
        return 2
    if args.max_tokens < 2:
        parser.error(f"--max-tokens must be at least 2 (ms a step needs two runs); got {args.max_tokens}")
    from warmcap.models.loader import load_tokenizer
    from warmcap.models.presets import resolve_model_path

    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    compile_ = args.device.startswith("cuda")
    rows: list[dict[str, Any]] = []
    print(
        f"bench_gpu {args.model} {args.dtype} on {torch.cuda.get_device_name() if compile_ else args.device}; "
        f"torch {torch.__version__}; {args.max_tokens} tokens a row, best of {args.rounds}"
    )
    print(
        f"{'peer':<20}{'batch':>6}{'ms/step':>10}{'tok/s':>11}{'kernels/step':>14}  tokens vs warmcap_graphs"
    )
    for batch in (int(b) for b in args.batches.split(",")):
        ids = batch_prompts(tokenizer, batch, chat=True)
        max_len = max(len(p) for p in ids) + args.max_tokens + 16
        reference: list[list[int]] | None = None
        for name in peers:
            if name.startswith("warmcap"):
                generate = warmcap_peer(
                    args.model, args.dtype, args.device, batch, max_len, eager=name == "warmcap_eager"
                )
            else:
                generate = hf_peer(
                    path, args.dtype, args.device, static=name == "hf_static_compile", compile_=compile_
                )
            row = measure(name, generate, ids, args.max_tokens, args.device, args.rounds)
            if name == "hf_static_compile" and not compile_:
                row["peer"] = "hf_static_nocompile"
            del generate
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            reference = reference if reference is not None else row["tokens"]
            diffs = [first_difference(a, b) for a, b in zip(reference, row["tokens"], strict=True)]
            row["identical_rows"] = sum(d is None for d in diffs)
            row["first_difference"] = min((d for d in diffs if d is not None), default=None)
            kernels = f"{row['kernels_per_step']:.0f}" if row["kernels_per_step"] is not None else "-"
            ms = f"{row['ms_per_step']:.2f}" if row["ms_per_step"] is not None else "-"
            parted = (
                ""
                if row["first_difference"] is None
                else f" (first difference at token {row['first_difference']})"
            )
            print(
                f"{row['peer']:<20}{batch:>6}{ms:>10}{row['tok_s']:>11.1f}{kernels:>14}  "
                f"{row['identical_rows']}/{batch} identical{parted}",
                flush=True,
            )
            rows.append(row)
    if args.out:
        Path(args.out).write_text(
            json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in rows], indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
