"""The engine under tensor parallelism on CPU (gloo): ``LLM(..., tensor_parallel_size=2)`` runs rank 0
in this process and rank 1 in a spawned worker, and generates exactly what one device does.

Only one tensor-parallel engine can live in a process at a time, so each test shuts its engine down
(``LLM.shutdown``) before the next starts, and references are computed first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from tp_ranks import save_tiny

from warmcap.distributed import RankFailedError
from warmcap.distributed.executor import TensorParallelStoppedError
from warmcap.errors import ConfigError, ModelLoadError
from warmcap.llm import LLM
from warmcap.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 7, 41], [300, 12], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
#: small pools and no graphs: these tests are about the ranks agreeing, start-up is tested apart
SMALL = {"max_model_len": 128, "max_num_seqs": 4, "enforce_eager": True}


def _run(model: str, tp: int, prompts: list, params: SamplingParams = GREEDY, **kwargs) -> dict:
    """Greedy tokens and each request's first sampling logits row (its prompt-final logits)."""
    llm = LLM(model, tensor_parallel_size=tp, **{**SMALL, **kwargs})
    try:
        first: dict[str, torch.Tensor] = {}

        def keep_first(req_ids, num_logits, logits):
            start = 0
            for req_id, n in zip(req_ids, num_logits.tolist(), strict=True):
                if n and req_id not in first:
                    first[req_id] = logits[start].clone()
                start += n

        llm.engine.runner.logits_hook = keep_first
        outs = llm.generate(prompts, params)
        metrics = llm.engine.spec_metrics
        return {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logits": torch.stack([first[o.request_id] for o in outs]),
            "drafts": metrics.num_draft_tokens,
        }
    finally:
        llm.shutdown()


def _live_children() -> set[int]:
    """Pids of this process's live descendants, multiprocessing's resource tracker aside (it
    outlives any engine by design)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
    return out


def _workers_gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


@pytest.fixture(scope="module")
def odd_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """KV heads that do not split evenly over two ranks: 3 (uneven, 2 + 1) and 1 (replicated)."""
    return {
        "llama-6q3kv": save_tiny(
            tmp_path_factory.mktemp("llama3kv"),
            "tiny-llama",
            "LlamaForCausalLM",
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=16,
        ),
        "qwen3-4q1kv": save_tiny(
            tmp_path_factory.mktemp("qwen3kv1"), "tiny-qwen3", "Qwen3ForCausalLM", num_key_value_heads=1
        ),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llama", "llama-6q3kv", "qwen3-4q1kv"])
def test_tp2_generates_what_tp1_generates(name, odd_models):
    model = str(odd_models.get(name, name))
    one = _run(model, 1, PROMPTS)
    two = _run(model, 2, PROMPTS)
    assert two["tokens"] == one["tokens"]
    torch.testing.assert_close(two["logits"], one["logits"], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.usefixtures("screen_on_every_cpu")
@pytest.mark.parametrize("spec", [None, "ngram:3"])
def test_tp2_greedy_steps_take_the_sharded_screen_and_keep_tp1s_tokens(spec, odd_models):
    """No logits hook: every greedy step asks the ranks' screened heads (one (logit, id) pair a row
    exchanged, no gathered logits), and the tokens are still TP=1's, drafts verified included."""
    from warmcap.models.greedy_head import ShardedGreedyHead

    model = str(odd_models["llama-6q3kv"])
    extra = {"speculative_config": spec} if spec else {}
    one = LLM(model, **SMALL, **extra)
    try:
        want = [list(o.outputs[0].token_ids) for o in one.generate(PROMPTS, GREEDY)]
    finally:
        one.shutdown()
    llm = LLM(model, tensor_parallel_size=2, **SMALL, **extra)
    try:
        runner = llm.engine.runner
        head = runner.greedy_head
        assert isinstance(head, ShardedGreedyHead) and head.local is not None
        answered: list[bool] = []

        class Counted:
            def argmax(self, x, *, decline=False):
                found = head.argmax(x, decline=decline)
                answered.append(found is not None)
                return found

        runner.greedy_head = Counted()
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()
    assert got == want
    assert answered and all(answered), f"the screen declined {answered.count(False)} of {len(answered)} steps"
    assert not head.off


@pytest.fixture(scope="module")
def tp2_without_spec() -> dict:
    return _run("tiny-llama", 2, PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["ngram:3", "draft_model:2", "eagle:2", "eagle3:2", "mtp:2", "dflash:2"])
def test_speculation_under_tp2_is_exact(spec, tp2_without_spec):
    """Replicated drafters (target embedding and LM head shared, sharded): same greedy tokens."""
    repetitive = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], *PROMPTS[1:]]
    prompts = repetitive if spec.startswith("ngram") else PROMPTS
    reference = tp2_without_spec if prompts is PROMPTS else _run("tiny-llama", 2, prompts)
    out = _run("tiny-llama", 2, prompts, speculative_config=spec)
    assert out["tokens"] == reference["tokens"]
    assert out["drafts"] > 0


@pytest.mark.slow
def test_killed_worker_fails_the_engine_naming_its_rank():
    llm = LLM("tiny-llama", tensor_parallel_size=2, **SMALL)
    pids = llm.engine.executor.worker_pids
    killed: list[float] = []

    def kill() -> None:
        killed.append(time.monotonic())
        os.kill(pids[0], signal.SIGKILL)

    try:
        # Killed once generation is under way (the engine is then inside or between steps).
        killer = threading.Timer(3.0, kill)
        killer.start()
        long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        with pytest.raises(RankFailedError, match=r"rank 1 failed: .*killed by signal 9") as err:
            while True:
                llm.generate(PROMPTS, long)
        assert time.monotonic() - killed[0] < 10
        assert err.value.rank == 1
        assert _workers_gone(pids)
        with pytest.raises(TensorParallelStoppedError, match="stopped"):
            llm.generate([PROMPTS[1]], GREEDY)
    finally:
        llm.shutdown()
    assert _workers_gone(pids)


@pytest.mark.slow
def test_dropping_the_llm_stops_its_workers():
    llm = LLM("tiny-llama", tensor_parallel_size=2, **SMALL)
    pids = llm.engine.executor.worker_pids
    assert not _workers_gone(pids)
    del llm
    import gc

    gc.collect()
    assert _workers_gone(pids)
    # The process may start another tensor-parallel engine afterwards.
    assert _run("tiny-llama", 2, PROMPTS[:1])["tokens"]


@pytest.mark.slow
def test_a_worker_error_names_its_rank_and_stops_every_worker():
    from tp_ranks import fail_on_worker

    from warmcap.engine import LLMEngine
    from warmcap.llm import build_config

    config = build_config("tiny-llama", tensor_parallel_size=2, **SMALL)
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(
        RankFailedError, match="rank 1 failed: RuntimeError: deliberate failure on the worker"
    ):
        LLMEngine(config, startup_hooks=[fail_on_worker])
    with pytest.raises(ConfigError, match="cannot be sent to the worker ranks"):
        LLMEngine(config, startup_hooks=[lambda ctx: None])
    leftover = set(psutil.Process().children(recursive=True)) - before
    assert not [p for p in leftover if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_tensor_parallel_size_is_validated():
    with pytest.raises(ConfigError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        LLM("tiny-llama", tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="not supported with tensor_parallel_size = 2"):
        LLM("tiny-llama", tensor_parallel_size=2, kv_role="consumer")


def test_unsharded_families_are_refused_before_any_worker_starts():
    before = _live_children()
    with pytest.raises(ModelLoadError, match="does not support tensor parallelism yet"):
        LLM("tiny-deepseek-v3", tensor_parallel_size=2, **SMALL)
    assert _live_children() == before
