"""vLLM's CPU engine as a benchmark peer, run by ``bench_throughput.py`` in its own process with the
interpreter of vLLM's virtualenv (``benchmarks/setup_vllm_cpu.sh`` creates ``.venv-vllm``).

It never imports warmcap. Protocol over stdin/stdout: the first stdin line is a JSON setup
(``model``, ``prompt_ids``, ``max_tokens``, ``max_model_len``, ``enforce_eager``,
``enable_prefix_caching``, optionally ``tensor_parallel_size``); after start-up
and a short warm-up request it prints ``@@READY``; then for each ``run`` line it generates once
(greedy, ``ignore_eos``) and prints ``@@RESULT {"seconds": ..., "token_ids": [[...], ...]}``.
Other stdout lines (vLLM's own log) are ignored by the reader.

The model threads are set by the caller through ``VLLM_CPU_OMP_THREADS_BIND`` (for example ``0``
for one thread on core 0); vLLM's scheduler runs in a process of its own besides those threads.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    setup = json.loads(sys.stdin.readline())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_compat import readable_model_dir

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in setup["prompt_ids"]]
    llm = LLM(
        model=str(readable_model_dir(setup["model"])),
        dtype="float32",
        enforce_eager=setup["enforce_eager"],
        max_model_len=setup["max_model_len"],
        max_num_seqs=len(prompts),
        # the caller's choice; True is vLLM's own default for this model
        enable_prefix_caching=setup.get("enable_prefix_caching", False),
        seed=0,
        tensor_parallel_size=setup.get("tensor_parallel_size", 1),
    )
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[:1], warm, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=setup["max_tokens"], ignore_eos=True)
    print("@@READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        # Every timed run starts from an empty prefix cache: hits come only from within the run.
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        ids = [list(o.outputs[0].token_ids) for o in outputs]
        print("@@RESULT " + json.dumps({"seconds": seconds, "token_ids": ids}), flush=True)


if __name__ == "__main__":
    main()
