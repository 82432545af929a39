"""I5: greedy output with any drafter equals greedy output without one, on a mixed batch with
chunked prefill, prompts around the 16-token block boundary and requests joining mid-run; and no
drafter writes outside the blocks the KV cache manager holds for the request (I2)."""

from __future__ import annotations

import pytest
from spec_rig import TINY_VOCAB, SpecRig, prompts

LENGTHS = (5, 15, 17, 31)
MAX_TOKENS = 10


def _joins(vocab: int, repetitive: bool) -> dict[int, list[tuple[str, list[int], int]]]:
    ps = prompts(vocab, LENGTHS, repetitive=repetitive)
    first = [(f"r{i}", p, MAX_TOKENS) for i, p in enumerate(ps[:2])]
    later = [(f"r{i}", p, MAX_TOKENS + i) for i, p in enumerate(ps[2:], 2)]
    return {0: first, 2: later}


@pytest.fixture(scope="module")
def baseline() -> dict[bool, dict[str, list[int]]]:
    vocab = TINY_VOCAB
    return {rep: SpecRig(spec=None, record=False).run(_joins(vocab, rep)) for rep in (False, True)}


@pytest.mark.parametrize(
    "spec",
    ["ngram:3", "draft_model:3", "draft_model:2@tiny-qwen3", "eagle:3", "eagle3:2", "mtp:2", "dflash:3"],
)
def test_greedy_output_is_unchanged_by_speculation(spec: str, baseline) -> None:
    vocab = TINY_VOCAB
    # Repetitive prompts give ngram real matches; the model drafters see both kinds.
    repetitive = spec.startswith("ngram")
    rig = SpecRig(spec=spec)
    assert rig.run(_joins(vocab, repetitive)) == baseline[repetitive]
    assert rig.metrics.num_drafts > 0
    assert rig.stray_writes() == []
    phases = {rec.phase for rec in rig.runner.kv_write_log.records}
    if spec.startswith(("draft_model", "eagle", "mtp")):
        assert {"draft_prefill", "draft_step_1"} <= phases
    elif spec.startswith("dflash"):
        assert {"draft_prefill", "draft_step_0"} <= phases


@pytest.mark.parametrize("spec", ["eagle:3", "dflash:2", "draft_model:2@tiny-qwen3"])
def test_prefix_cache_hits_keep_speculation_exact(spec: str) -> None:
    """A request reusing cached blocks (target and drafter groups) drafts as if it computed them."""
    from warmcap.drafters import reference

    shared = prompts(TINY_VOCAB, (40,), seed=9)[0]
    joins = {0: [("first", [*shared, 7, 8], 6)], 4: [("second", [*shared, 9], 8)]}
    expected = SpecRig(spec=None, record=False).run(joins)
    rig = SpecRig(spec=spec)
    assert rig.run(joins) == expected
    assert rig.manager.stats.prefix_cache_hits >= 16
    assert rig.stray_writes() == []
    d, k = rig.drafter, rig.drafter.num_speculative_tokens
    for req_id, tokens, drafts in rig.proposals:
        if d.method == "draft_model":
            ref = reference.reference_draft_model(d.model, tokens, k)
        elif d.method == "dflash":
            ref = reference.reference_dflash(d.head, rig.model, tokens, k, d.aux_layers)
        else:
            ref = reference.reference_hidden_head(d.head, rig.model, tokens, k, d.aux_layers)
        assert drafts == ref[: len(drafts)], req_id


@pytest.mark.parametrize("spec", ["ngram:3", "eagle:2", "draft_model:2@self"])
def test_seeded_sampling_with_drafts_is_reproducible(spec: str) -> None:
    """Random requests verify drafts by speculative sampling; a seeded request repeats exactly."""
    from warmcap.llm import LLM
    from warmcap.sampling_params import SamplingParams

    # each prompt under two seeds: four sampled continuations, so some repeat the motif and ngram drafts
    ps = prompts(TINY_VOCAB, (12, 20), seed=4, repetitive=True) * 2
    params = [
        SamplingParams(temperature=0.3, top_p=0.9, seed=s, max_tokens=12, ignore_eos=True)
        for s in (1, 2, 3, 4)
    ]
    runs = []
    for _ in range(2):
        llm = LLM("tiny-llama", device="cpu", speculative_config=spec, num_blocks=64, max_model_len=128)
        runs.append([o.token_ids for o in llm.generate(ps, params)])
        assert llm.engine.spec_metrics.num_drafts > 0
    assert runs[0] == runs[1]
    assert all(len(t) == 12 for t in runs[0])
