"""lm-evaluation-harness (0.4.13, pinned in requirements-test.txt) as a real client.

Its ``local-completions`` backend against ``warmup serve`` of SmolLM2 (captured graphs; and again
with ``ngram:4`` speculation) and its ``hf`` backend on the same converted weights, on the task set
shipped in ``tests/data/lm_eval`` (multiple choice, rolling perplexity, greedy generate-until):
identical acc / acc_norm and exact_match, perplexities within 1e-3 relative, every per-item
loglikelihood within 1e-3, greedy generations equal. Loglikelihood requests are lm-eval's own:
``echo`` with ``logprobs: 1`` and ``max_tokens: 1`` over token-id prompts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from serve_fixtures import running

from warmcap.config import StartupOptions
from warmcap.llm import build_config
from warmcap.models.presets import resolve_model
from warmcap.serve import ServeOptions, build_app

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

MODEL = "smollm2-135m"
REPO = Path(__file__).resolve().parents[2]
TASK_DIR = REPO / "tests" / "data" / "lm_eval"
TASKS = ("warmcap_mc", "warmcap_ppl", "warmcap_gen")
#: the server's context; lm-eval's window is one token shorter for API models (it keeps one to generate)
MAX_LEN = 512
ENGINE_KW = {"device": "cpu", "max_model_len": MAX_LEN, "max_num_seqs": 8}
REL_TOL = 1e-3
ABS_TOL = 1e-3
METRICS = {
    "warmcap_mc": ("acc,none", "acc_norm,none"),
    "warmcap_ppl": ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"),
    "warmcap_gen": ("exact_match,none",),
}


def _task_configs(cache_dir: Path) -> list[dict[str, Any]]:
    """The shipped YAMLs with their data files made absolute (the YAMLs name them from the
    repository root, where ``lm_eval --include_path tests/data/lm_eval`` is run)."""
    configs = []
    for name in TASKS:
        config = yaml.safe_load((TASK_DIR / f"{name}.yaml").read_text())
        files = config["dataset_kwargs"]["data_files"]
        files["test"] = str(REPO / files["test"])
        config["dataset_kwargs"]["cache_dir"] = str(cache_dir)
        configs.append(config)
    return configs


def _evaluate(model: str, model_args: dict[str, Any], cache_dir: Path) -> dict[str, Any]:
    import lm_eval

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=_task_configs(cache_dir),
        log_samples=True,
        bootstrap_iters=0,
        random_seed=0,
    )


@pytest.fixture(scope="module")
def hf_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    args = {
        "pretrained": str(resolve_model(MODEL)),
        "dtype": "float32",
        "device": "cpu",
        "batch_size": 1,
        "max_length": MAX_LEN - 1,
    }
    return _evaluate("hf", args, tmp_path_factory.mktemp("datasets"))


def _served(spec: str | None, cache_dir: Path) -> dict[str, Any]:
    config = build_config(MODEL, speculative_config=spec, **ENGINE_KW)
    with running(build_app(config, ServeOptions(startup=StartupOptions(capture_sizes=(1, 2, 4, 8))))) as srv:
        srv.wait_ready()
        args = {
            "model": MODEL,
            "base_url": f"{srv.base_url}/v1/completions",
            "tokenizer": str(resolve_model(MODEL)),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "batch_size": 8,
            "max_length": MAX_LEN,
            "max_retries": 1,
        }
        return _evaluate("local-completions", args, cache_dir)


def _per_doc(results: dict[str, Any], task: str) -> dict[int, list]:
    return {s["doc_id"]: s["filtered_resps"] for s in results["samples"][task]}


def _table(hf: dict[str, Any], served: dict[str, Any], label: str) -> str:
    rows = [f"{'task':12} {'metric':22} {'hf':>12} {label:>12}"]
    for task, names in METRICS.items():
        for name in names:
            rows.append(
                f"{task:12} {name:22} {hf['results'][task][name]:12.6f} {served['results'][task][name]:12.6f}"
            )
    return "\n".join(rows)


@pytest.mark.parametrize("spec", [None, "ngram:4"], ids=["plain", "ngram4"])
def test_lm_eval_through_the_server_equals_its_hf_backend(
    spec: str | None, hf_results: dict[str, Any], tmp_path: Path
) -> None:
    served = _served(spec, tmp_path)
    print(_table(hf_results, served, spec or "warmcap"))

    for metric in ("acc,none", "acc_norm,none"):
        assert served["results"]["warmcap_mc"][metric] == hf_results["results"]["warmcap_mc"][metric]
    assert (
        served["results"]["warmcap_gen"]["exact_match,none"]
        == hf_results["results"]["warmcap_gen"]["exact_match,none"]
    )
    for metric in METRICS["warmcap_ppl"]:
        assert served["results"]["warmcap_ppl"][metric] == pytest.approx(
            hf_results["results"]["warmcap_ppl"][metric], rel=REL_TOL
        )

    # Every item: each choice's loglikelihood (and whether it is the greedy continuation), each
    # paragraph's rolling loglikelihood, each generation's text.
    for task in TASKS:
        want, got = _per_doc(hf_results, task), _per_doc(served, task)
        assert sorted(got) == sorted(want) and len(want) > 0
        for doc_id, resps in want.items():
            mine = got[doc_id]
            assert len(mine) == len(resps)
            for w, g in zip(resps, mine, strict=True):
                if task == "warmcap_gen":
                    assert g == w, (doc_id, g, w)
                elif task == "warmcap_mc":
                    (w_ll, w_greedy), (g_ll, g_greedy) = w, g
                    assert abs(g_ll - w_ll) <= ABS_TOL, (doc_id, g_ll, w_ll)
                    assert g_greedy == w_greedy
                else:
                    assert abs(float(g) - float(w)) <= ABS_TOL, (doc_id, g, w)
