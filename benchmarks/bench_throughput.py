"""Offline throughput: warmcap vs vLLM's CPU engine vs transformers ``generate`` (left-padded batch)
vs transformers paged ``generate_batch``, on the same token ids and the same weights.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_throughput.py --peers warmcap,vllm,hf_generate \
        --threads 1 --rounds 3 [--eager] [--vllm-python .venv-vllm/bin/python]

The workload ships here (``benchmarks/data/bench_prompts.jsonl``): the first ``--num-prompts``
``general`` prompts through the model's chat template, ``--max-tokens`` new tokens, greedy,
``ignore_eos`` (every peer generates exactly ``max_tokens`` per prompt). Each engine first runs one
short warm-up request; a timed run is one call over all prompts. Rounds alternate the peers
(A B C, A B C, ...) and each round prints its load average, every peer's rate and its ratio to
warmcap; the best round of each peer is summarised. Outputs are compared token by token with
warmcap's in every round, and any difference is reported.

vLLM runs in a process of its own with its own virtualenv's interpreter (``vllm_peer.py``;
``setup_vllm_cpu.sh`` creates ``.venv-vllm``). Its model threads are pinned to ``--threads`` cores
with ``VLLM_CPU_OMP_THREADS_BIND``: by default vLLM keeps one core for its scheduler process, so
without the pin the peers would not compute on the same number of model threads. Between its own
runs its processes are stopped (SIGSTOP, SIGCONT before its next run): idle, they still take ~17 % of
a core, which a peer timed meanwhile would pay.

Prefix caching is each engine's default unless ``--no-prefix-caching`` (on in both: warmcap decides
per model and turns it on here; vLLM's CPU build enables it for non-MLA models). The prompts share
the chat template's 24-token system prefix; what each engine makes of that is part of its speed
(warmcap's 16-token blocks share one block per prompt, registered as soon as the step that writes
it is scheduled; vLLM's CPU build uses 128-token blocks, which this prefix never fills).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DEFAULT_PROMPTS = HERE / "data" / "bench_prompts.jsonl"
DEFAULT_VLLM_PYTHON = HERE.parent / ".venv-vllm" / "bin" / "python"


def load_prompts(path: Path, n: int, kind: str | None = "general") -> list[str]:
    """The first ``n`` prompts of ``kind`` (None: of any kind) in the workload file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows if kind is None or r.get("kind") == kind][:n]


def prompt_ids(tokenizer, prompts: list[str], *, chat: bool) -> list[list[int]]:
    """Token ids every peer receives: through the chat template (one user turn) or plain."""
    if not chat:
        return [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids))
    return out


Runner = Callable[[], list[list[int]]]


def warmcap_llm(
    path: Path,
    ids: list[list[int]],
    max_tokens: int,
    *,
    batch_invariant: bool = False,
    eager: bool = False,
    prefix_caching: bool = True,
):
    """warmcap's ``LLM`` as this benchmark configures it: every prompt in one step and one batch."""
    from warmcap.llm import LLM

    return LLM(
        str(path),
        device="cpu",
        max_num_seqs=len(ids),
        max_num_batched_tokens=max(512, sum(len(p) for p in ids)),
        max_model_len=max(len(p) for p in ids) + max_tokens + 16,
        # None: warmcap's own default (on wherever every KV group can serve hits)
        enable_prefix_caching=None if prefix_caching else False,
        batch_invariant=batch_invariant,
        enforce_eager=eager,
    )


def warmcap_runner(
    path: Path,
    ids: list[list[int]],
    max_tokens: int,
    *,
    batch_invariant: bool = False,
    eager: bool = False,
    packed: bool = True,
    grouped: bool = True,
    prefix_caching: bool = True,
    attention: str | None = None,
    layer_ops: str | None = None,
    gemm: str | None = None,
    greedy_head: bool = True,
    **_: object,
) -> Runner:
    from warmcap.kernels.cpu.gemm import ENV as GEMM_ENV
    from warmcap.kernels.cpu.layer_ops import ENV as LAYER_OPS_ENV
    from warmcap.kernels.cpu.paged_attention import ENV as ATTENTION_ENV
    from warmcap.models.packed_linear import prepack_linears, unpack_linears
    from warmcap.sampling_params import SamplingParams

    # The CPU kernels are chosen when the engine builds its model and backend: set only around that.
    switches = {ATTENTION_ENV: attention, LAYER_OPS_ENV: layer_ops, GEMM_ENV: gemm}
    saved = {env: os.environ.get(env) for env in switches}
    for env, mode in switches.items():
        if mode is not None:
            os.environ[env] = mode
    try:
        llm = warmcap_llm(
            path, ids, max_tokens, batch_invariant=batch_invariant, eager=eager, prefix_caching=prefix_caching
        )
    finally:
        for env, value in saved.items():
            if value is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = value
    if not packed:
        # The peer for models/packed_linear.py: the same engine on plain F.linear.
        unpack_linears(llm.engine.model)
    elif not grouped:
        # The peer for PackedGroup: q/k/v and gate/up packed one by one, three and two GEMMs.
        unpack_linears(llm.engine.model)
        prepack_linears(llm.engine.model, groups=False)
    if not greedy_head:
        # The peer for models/greedy_head.py: the full float32 logits on every step.
        llm.engine.runner.greedy_head = None
    llm.generate([ids[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def run() -> list[list[int]]:
        # Every timed run starts from an empty prefix cache: hits come only from within the run.
        llm.engine.kv_cache_manager.reset_prefix_cache()
        return [o.token_ids for o in llm.generate(ids, params)]

    return run


def hf_generate_runner(path: Path, ids: list[list[int]], max_tokens: int, **_: object) -> Runner:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    width = max(len(p) for p in ids)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])

    def run(n: int = max_tokens, rows: int = len(ids)) -> list[list[int]]:
        with torch.inference_mode():
            out = model.generate(
                input_ids[:rows],
                attention_mask=mask[:rows],
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )
        return out[:, width:].tolist()

    run(4, 1)
    return run


def hf_paged_runner(path: Path, ids: list[list[int]], max_tokens: int, **_: object) -> Runner:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="paged|sdpa"
    ).eval()

    def run(n: int = max_tokens, prompts: list[list[int]] = ids) -> list[list[int]]:
        # eos -1 never matches: the same ignore_eos the other peers use.
        config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)
        with torch.inference_mode():
            result = model.generate_batch(inputs=prompts, generation_config=config)
        by_prompt = {tuple(o.prompt_ids): o.generated_tokens for o in result.values()}
        return [by_prompt.get(tuple(p), []) for p in prompts]

    run(4, ids[:1])
    return run


class VllmPeer:
    """vLLM in its own process (``vllm_peer.py``), driven one timed run per call."""

    def __init__(
        self,
        path: Path,
        ids: list[list[int]],
        max_tokens: int,
        *,
        eager: bool = False,
        threads: int = 1,
        vllm_python: Path = DEFAULT_VLLM_PYTHON,
        prefix_caching: bool = True,
        **_: object,
    ) -> None:
        if not Path(vllm_python).is_file():
            sys.exit(
                f"vLLM's interpreter {str(vllm_python)!r} does not exist: run benchmarks/setup_vllm_cpu.sh "
                "or pass --vllm-python"
            )
        env = dict(os.environ)
        # NOTE: one core per model thread, pinned; vLLM's scheduler process runs beside them.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads <= 1 else f"0-{threads - 1}"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            [str(vllm_python), str(HERE / "vllm_peer.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            # its own process group: the engine core and worker processes it starts are stopped and
            # continued with it (``pause``/``resume``)
            start_new_session=True,
        )
        setup = {
            "model": str(path),
            "prompt_ids": ids,
            "max_tokens": max_tokens,
            "max_model_len": max(len(p) for p in ids) + max_tokens + 16,
            "enforce_eager": eager,
            "enable_prefix_caching": prefix_caching,
        }
        self._send(json.dumps(setup))
        self._read("@@READY")
        self.pause()

    def pause(self) -> None:
        """Stop every process of the peer so that its idle polling costs the other peers nothing."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _read(self, marker: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(marker):
                return line[len(marker) :].strip()
        sys.exit(f"the vLLM peer exited ({self.proc.wait()}) before {marker}: see its log above")

    def __call__(self) -> list[list[int]]:
        self.resume()
        try:
            self._send("run")
            result = json.loads(self._read("@@RESULT"))
        finally:
            self.pause()
        # The peer's own timing excludes the pipe; the caller's clock includes it (a few ms).
        return result["token_ids"]

    def close(self) -> None:
        self.resume()
        if self.proc.poll() is None:
            self._send("stop")
            self.proc.wait(timeout=60)


PEERS: dict[str, Callable[..., Runner]] = {
    "warmcap": warmcap_runner,
    "vllm": VllmPeer,
    # the same engine with fixed-shape GEMM tiles (--batch-invariant): the price of invariance
    "warmcap_batch_invariant": partial(warmcap_runner, batch_invariant=True),
    "warmcap_unpacked": partial(warmcap_runner, packed=False),
    "warmcap_ungrouped": partial(warmcap_runner, grouped=False),
    # the same engine on gather + SDPA attention: the peer for the CPU paged-attention kernel
    "warmcap_torch_attention": partial(warmcap_runner, attention="torch"),
    # the same engine on torch's RMSNorm and RoPE: the peer for kernels/cpu/layer_ops.c
    "warmcap_torch_layer_ops": partial(warmcap_runner, layer_ops="torch"),
    # the same engine on oneDNN's packed GEMM (vLLM's CPU kernel): the peer for kernels/cpu/gemm.c
    "warmcap_onednn": partial(warmcap_runner, gemm="torch"),
    # the same engine computing the full float32 logits every step: the peer for models/greedy_head.py
    "warmcap_full_head": partial(warmcap_runner, greedy_head=False),
    "hf_generate": hf_generate_runner,
    "hf_paged": hf_paged_runner,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="preset name or HF directory")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="chat template")
    parser.add_argument("--peers", default="warmcap,vllm,hf_generate")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="no graphs in warmcap, no torch.compile in vLLM")
    parser.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each engine's default prefix caching (on in both); --no-prefix-caching turns it off in both",
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=Path(os.environ.get("WARMCAP_VLLM_PYTHON") or DEFAULT_VLLM_PYTHON),
        help="vLLM's interpreter (default: $WARMCAP_VLLM_PYTHON or .venv-vllm/bin/python of this repo)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="model threads of every peer (torch intra-op threads; vLLM's OMP threads, pinned)",
    )
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    from warmcap.models.loader import load_tokenizer
    from warmcap.models.presets import resolve_model

    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    ids = prompt_ids(tokenizer, load_prompts(args.prompts, args.num_prompts), chat=args.chat)
    print(
        f"model {args.model}: {len(ids)} prompts ({sum(map(len, ids))} prompt tokens, "
        f"chat template {'on' if args.chat else 'off'}) x {args.max_tokens} new tokens, greedy, ignore_eos"
    )
    print(
        f"model threads per peer: {args.threads}; {'eager' if args.eager else 'default (graphs / compile)'}; "
        f"prefix caching {'at each engine default (on)' if args.prefix_caching else 'off'}"
    )

    names = args.peers.split(",")
    extra = {
        "eager": args.eager,
        "threads": args.threads,
        "vllm_python": args.vllm_python,
        "prefix_caching": args.prefix_caching,
    }
    runners = {name: PEERS[name](path, ids, args.max_tokens, **extra) for name in names}
    best: dict[str, float] = {}
    outputs: dict[str, list[list[int]]] = {}
    mismatches: list[str] = []
    try:
        # Rounds alternate the peers so a burst of load on a shared machine hits all of them.
        for r in range(args.rounds):
            seconds: dict[str, float] = {}
            for name, run in runners.items():
                start = time.perf_counter()
                outputs[name] = run()
                seconds[name] = time.perf_counter() - start
                best[name] = min(best.get(name, float("inf")), seconds[name])
            load = " ".join(f"{x:.1f}" for x in os.getloadavg())
            line = [f"round {r + 1} (load {load}):"]
            for name in names:
                rate = sum(map(len, outputs[name])) / seconds[name]
                line.append(f"{name} {rate:.1f} tok/s")
                if name != names[0]:
                    line.append(f"({names[0]} / {name} {seconds[name] / seconds[names[0]]:.2f}x)")
                    same = sum(a == b for a, b in zip(outputs[names[0]], outputs[name], strict=True))
                    if same != len(ids):
                        mismatches.append(
                            f"round {r + 1}: {name} differs from {names[0]} in {len(ids) - same}/{len(ids)}"
                        )
            print(" ".join(line), flush=True)
    finally:
        for run in runners.values():
            if isinstance(run, VllmPeer):
                run.close()

    print(f"best of {args.rounds} rounds:")
    rate = {}
    for name, secs in best.items():
        tokens = sum(len(o) for o in outputs[name])
        rate[name] = tokens / secs
        print(f"  {name:24s} {tokens:6d} tokens in {secs:7.2f} s = {rate[name]:8.1f} tokens/s")
    first = names[0]
    for name in names[1:]:
        same = sum(a == b for a, b in zip(outputs[first], outputs[name], strict=True))
        print(
            f"  {first} / {name}: {rate[first] / rate[name]:.2f}x  (token-identical outputs, last round: {same}/{len(ids)})"
        )
    if mismatches:
        print("OUTPUTS ARE NOT TOKEN-IDENTICAL between peers:")
        for m in mismatches:
            print(f"  {m}")
    else:
        print(f"outputs token-identical between all peers in every round ({len(ids)}/{len(ids)})")


if __name__ == "__main__":
    main()
