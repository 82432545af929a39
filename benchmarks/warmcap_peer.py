"""warmcap as a benchmark peer in a process of its own, driven like ``vllm_peer.py``: whichever
warmcap ``PYTHONPATH`` finds (this tree, or a baseline checkout's ``src``), so two versions of the
engine can be timed side by side in one run (``bench_contention.py``). A process of its own also
gives each peer its own OpenMP runtime, started with the environment the caller chose.

Protocol over stdin/stdout: the first stdin line is a JSON setup (``model``, ``prompt_ids``,
``max_tokens``, ``max_model_len``, ``enforce_eager``, ``threads``, optional ``engine_args``: extra
``LLM`` keywords); after start-up and a short warm-up request it prints ``@@READY`` with a JSON
line describing its threads; then for each ``run`` line it generates once (greedy, ``ignore_eos``)
and prints ``@@RESULT {"seconds": ..., "token_ids": [[...], ...]}``.

``threads``: the model threads. A warmcap that has the ``cpu_threads`` engine option gets it (its
own thread policy then applies: wait policy, binding); an older one gets ``torch.set_num_threads``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    setup = json.loads(sys.stdin.readline())
    # warmcap first: a warmcap that sets OpenMP's environment must see it before torch loads.
    import warmcap
    from warmcap.engine_args import ENGINE_KWARGS
    from warmcap.llm import LLM
    from warmcap.sampling_params import SamplingParams

    torch = sys.modules["torch"]  # loaded by the engine's modules, after warmcap's own set-up

    ids = setup["prompt_ids"]
    kwargs = dict(setup.get("engine_args") or {})
    threads = setup["threads"]
    if threads is None:
        pass  # the engine's own default
    elif "cpu_threads" in ENGINE_KWARGS:
        kwargs.setdefault("cpu_threads", threads)
    else:
        torch.set_num_threads(threads)
    llm = LLM(
        setup["model"],
        device="cpu",
        max_num_seqs=len(ids),
        max_num_batched_tokens=max(512, sum(len(p) for p in ids)),
        max_model_len=setup["max_model_len"],
        enforce_eager=setup["enforce_eager"],
        **kwargs,
    )
    llm.generate([ids[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=setup["max_tokens"], ignore_eos=True)
    info = {
        "warmcap": os.path.dirname(warmcap.__file__),
        "torch_threads": torch.get_num_threads(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))},
    }
    print("@@READY " + json.dumps(info), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        # Every timed run starts from an empty prefix cache: hits come only from within the run.
        llm.engine.kv_cache_manager.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(ids, params)
        seconds = time.perf_counter() - start
        print(
            "@@RESULT " + json.dumps({"seconds": seconds, "token_ids": [o.token_ids for o in outputs]}),
            flush=True,
        )
    llm.shutdown()


if __name__ == "__main__":
    main()
