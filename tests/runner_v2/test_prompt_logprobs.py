"""Prompt logprobs (``SamplingParams.prompt_logprobs``).

On SmolLM2, against transformers' log-softmax over the same prompt (float32, <= 1e-4): a prompt
longer than the step's token budget (chunked prefill), a prompt prefilled while another request
decodes in the same step, the same with ngram speculation and captured graphs, and a prompt whose
prefix is in the prefix cache. The LM head's row chunking against one full pass, on a random head.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.core.request import Request
from warmcap.llm import LLM
from warmcap.models.presets import resolve_model
from warmcap.runner_v2 import prompt_logprobs as plp
from warmcap.sampling_params import SamplingParams

MODEL = "smollm2-135m"
TOL = 1e-4
#: a step's token budget below the prompts' lengths, so every prompt is prefilled in several chunks
BUDGET = 32
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from those used for wine. "
    "Within fifty years presses were running in more than two hundred cities across Europe, and the "
    "price of books fell so far that ordinary merchants could own them."
)
#: two seats, a small fixed pool: start-up (KV sizing, warmup, graph capture) stays short
ENGINE_KW = {"device": "cpu", "max_model_len": 192, "max_num_seqs": 2, "num_blocks": 40}
#: repeats itself, so the ngram drafter proposes while it decodes
REPEATING = "one two three four five six seven eight, one two three four five six seven eight, one two three"


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(resolve_model(MODEL)), dtype=torch.float32).eval()


def _want(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _assert_matches(entries, ids: list[int], want: torch.Tensor, k: int) -> None:
    """vLLM's shape (None first, then the prompt token first and the k most likely) and values."""
    assert entries is not None and len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        entry, tok, row = entries[p], ids[p], want[p - 1]
        assert next(iter(entry)) == tok
        assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=TOL)
        # The rank counts strictly more likely tokens; near-ties within the tolerance may go either way.
        v = float(row[tok])
        assert int((row > v + TOL).sum()) + 1 <= entry[tok].rank <= int((row > v - TOL).sum()) + 1
        top_ids = [t for _, t in sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= k)]
        assert len(top_ids) == k
        if not k:
            assert list(entry) == [tok]
            continue
        kth = float(row.topk(k).values[-1])
        for t in top_ids:
            assert float(row[t]) >= kth - TOL  # one of the k most likely
            assert entry[t].logprob == pytest.approx(float(row[t]), abs=TOL)


def _prefill_beside_a_decode(engine, ids, *, other_tokens: int, target_params: SamplingParams, counts):
    """A request decoding (``REPEATING``, two steps ahead), then ``ids`` prefilled beside it with
    ``target_params``, run to the end: (finished outputs by id, the two ids, how many steps that
    held both made ``counts(scheduled, drafts, other, target)`` true)."""
    other = engine.add_request(
        REPEATING, SamplingParams(temperature=0, max_tokens=other_tokens, ignore_eos=True)
    )
    engine.step()
    engine.step()
    target = engine.add_request({"prompt_token_ids": ids}, target_params)
    seen = 0
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        step = engine.runner.last_step
        if step is not None and {other, target} <= set(step.req_ids):
            n = dict(zip(step.req_ids, step.num_scheduled.tolist(), strict=True))
            drafts = dict(zip(step.req_ids, step.draft_token_ids, strict=True))
            seen += bool(counts(n, drafts, other, target))
    return done, other, target, seen


@pytest.mark.slow
@pytest.mark.real_model
def test_chunked_prompt_mixed_with_a_decode_equals_transformers(hf) -> None:
    llm = LLM(MODEL, max_num_batched_tokens=BUDGET, enforce_eager=True, **ENGINE_KW)
    engine = llm.engine
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT)
    assert len(ids) > 2 * BUDGET
    want = _want(hf, ids)

    # Alone: chunked over several steps.
    [out] = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5)
    )
    _assert_matches(out.prompt_logprobs, ids, want, 5)
    assert out.outputs[0].logprobs is None  # prompt logprobs ask nothing of the sampled tokens

    # Inside a mixed batch: another request decodes in the steps that prefill this one.
    def chunk_beside_decode(n: dict, drafts: dict, other: str, target: str) -> bool:
        return n[other] == 1 and n[target] > 1

    done, _, target, mixed = _prefill_beside_a_decode(
        engine, ids, other_tokens=40,
        target_params=SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
        counts=chunk_beside_decode,
    )  # fmt: skip
    assert mixed >= 2  # several of the target's chunks ran beside the other's decode
    entries = done[target].prompt_logprobs
    _assert_matches(entries, ids, want, 0)


@pytest.mark.slow
@pytest.mark.real_model
def test_prefix_cache_hit_loses_no_position(hf) -> None:
    """A prompt whose prefix is cached is computed in full for its prompt logprobs (as vLLM skips
    the prefix cache for them); a plain request still reads the cache."""
    llm = LLM(MODEL, enable_prefix_caching=True, enforce_eager=True, **ENGINE_KW)
    ids = llm.get_tokenizer().encode(PROMPT)
    llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))
    kv = llm.engine.kv_cache_manager
    _, plain_hit = kv.get_computed_blocks(Request("plain", list(ids), SamplingParams()))
    _, logprobs_hit = kv.get_computed_blocks(Request("lp", list(ids), SamplingParams(prompt_logprobs=1)))
    assert plain_hit >= 48 and logprobs_hit == 0
    [out] = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    )
    _assert_matches(out.prompt_logprobs, ids, _want(hf, ids), 1)


@pytest.mark.slow
@pytest.mark.real_model
def test_speculation_and_graphs_keep_prompt_logprobs_exact(hf) -> None:
    """ngram:4 drafts and verifies for a decoding request while another is prefilled in chunks,
    with the step graphs captured (not ``enforce_eager``)."""
    llm = LLM(
        MODEL, device="cpu", max_model_len=256, max_num_batched_tokens=BUDGET, speculative_config="ngram:4"
    )
    engine = llm.engine
    assert engine.runner.graphs is not None
    ids = llm.get_tokenizer().encode(PROMPT)

    def verify_beside_chunk(n: dict, drafts: dict, other: str, target: str) -> bool:
        return bool(drafts[other]) and n[target] > len(drafts[target]) + 1

    done, other, target, drafted_beside = _prefill_beside_a_decode(
        engine, ids, other_tokens=48,
        target_params=SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2),
        counts=verify_beside_chunk,
    )  # fmt: skip
    assert drafted_beside >= 1  # a verify step and a prompt chunk shared a step
    _assert_matches(done[target].prompt_logprobs, ids, _want(hf, ids), 2)
    # The speculating request's own tokens are plain greedy decoding's.
    plain = _want(hf, llm.get_tokenizer().encode(REPEATING))
    assert done[other].token_ids[0] == int(plain[-1].argmax())


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    num_prompt=st.integers(2, 40),
    chunk_rows=st.integers(1, 9),
    k=st.integers(0, 4),
)
def test_parts_over_any_chunking_equal_one_full_pass(data, num_prompt, chunk_rows, k) -> None:
    """However a prompt is cut into steps (and the LM head's rows into chunks), the parts together
    are the full prompt's log-softmax at every position after the first, nothing twice."""
    torch.manual_seed(num_prompt)
    vocab, width = 23, 8
    head = torch.randn(vocab, width)
    hidden_all = torch.randn(num_prompt, width)
    tokens = np.zeros((2, num_prompt + 4), dtype=np.int64)
    tokens[1, :num_prompt] = np.asarray(
        data.draw(st.lists(st.integers(0, vocab - 1), min_size=num_prompt, max_size=num_prompt))
    )
    full = (hidden_all @ head.T).log_softmax(-1)

    got: dict[int, tuple[float, int, list[int]]] = {}
    done = 0
    while done < num_prompt:
        n = data.draw(st.integers(1, num_prompt - done))
        # A decoding neighbour in row 0 (prompt logprobs off) comes first in the step.
        hidden = torch.cat([torch.randn(1, width), hidden_all[done : done + n]])
        parts = plp.prompt_logprobs_parts(
            lambda h: h @ head.T,
            hidden,
            req_ids=["decode", "prompt"],
            rows=np.array([0, 1]),
            num_top=np.array([-1, k]),
            query_start=np.array([0, 1]),
            computed=np.array([7, done]),
            num_scheduled=np.array([1, n]),
            num_prompt_tokens=np.array([3, num_prompt]),
            token_ids=tokens,
            chunk_rows=chunk_rows,
        )
        assert "decode" not in parts
        part = parts.get("prompt")
        if part is not None:
            for j in range(len(part.token_ids)):
                pos = part.start + j
                assert pos not in got
                got[pos] = (float(part.logprobs[j]), int(part.ranks[j]), part.top_ids[j].tolist())
        done += n
    assert sorted(got) == list(range(1, num_prompt))
    for pos, (lp, rank, top) in got.items():
        row, tok = full[pos - 1], int(tokens[1, pos])
        assert lp == pytest.approx(float(row[tok]), abs=1e-5)
        assert rank == int((row > row[tok]).sum()) + 1
        assert top == row.topk(k).indices.tolist()
