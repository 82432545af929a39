"""The vLLM-compatible surface of ``LLM``: output shape, dict prompts, ``n``, stop strings,
logprobs, ``top_k=-1``, vLLM keyword arguments, and BOS as the tokenizer adds it (transformers as
the oracle)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from warmcap.cli import app
from warmcap.errors import ConfigError
from warmcap.llm import LLM, build_config
from warmcap.models.presets import resolve_model
from warmcap.sampling_params import SamplingParams

PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-llama", device="cpu", max_model_len=128, num_blocks=64, block_size=16)


def _assert_pool_clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.num_blocks - 1


def test_outputs_have_vllm_shape_and_the_old_fields(llm: LLM) -> None:
    [out] = llm.generate(PROMPT, GREEDY)
    [completion] = out.outputs
    assert completion.index == 0 and completion.finish_reason == "length" and out.finished
    assert completion.text == out.text == llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)
    assert completion.token_ids == out.token_ids and len(out.token_ids) == 24
    assert completion.logprobs is None and completion.stop_reason is None


def test_dict_and_bare_prompts_mean_the_same_as_plain_ones(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode(PROMPT)
    outs = llm.generate([PROMPT, {"prompt": PROMPT}, {"prompt_token_ids": ids}, ids], GREEDY)
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == [PROMPT, PROMPT, None, None]
    assert all(o.prompt_token_ids == ids for o in outs)
    # a flat list of ids is one prompt, as in vLLM
    [bare] = llm.generate(ids, GREEDY, use_tqdm=True)
    assert bare.token_ids == outs[0].token_ids


def test_n_samples_are_independent_seeded_requests_gathered(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    [out] = llm.generate(PROMPT, SamplingParams(n=3, **_fields(params)))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = [
        llm.generate(PROMPT, SamplingParams(**{**_fields(params), "seed": 7 + i}))[0].token_ids
        for i in range(3)
    ]
    assert [c.token_ids for c in out.outputs] == singles
    assert len({tuple(s) for s in singles}) > 1  # it really samples
    _assert_pool_clean(llm)


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in ("temperature", "seed", "max_tokens", "ignore_eos")}


def _stop_string(text: str) -> str:
    """A 3-character piece of ``text`` that first occurs well inside it."""
    for k in range(4, len(text) - 3):
        s = text[k : k + 3]
        if text.index(s) == k and s.strip():
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_end_the_text_before_their_first_occurrence(llm: LLM) -> None:
    [ref] = llm.generate(PROMPT, GREEDY)
    stop = _stop_string(ref.text)
    at = ref.text.index(stop)
    tok = llm.get_tokenizer()

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    [out] = llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop, "@@@"])
    )
    [c] = out.outputs
    assert (c.text, c.finish_reason, c.stop_reason) == (ref.text[:at], "stop", stop)
    # the tokens end with the one that completed the stop string
    assert c.token_ids == ref.token_ids[: len(c.token_ids)]
    assert stop in decode(c.token_ids) and stop not in decode(c.token_ids[:-1])
    _assert_pool_clean(llm)

    kept = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop=stop, include_stop_str_in_output=True
    )
    assert llm.generate(PROMPT, kept)[0].text == ref.text[: at + len(stop)]
    streamed = "".join(
        llm.generate_stream(
            PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=stop)
        )
    )
    assert streamed == ref.text[:at]
    # before min_tokens a stop string does not count
    late = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop=stop, min_tokens=len(c.token_ids) + 1
    )
    assert len(llm.generate(PROMPT, late)[0].token_ids) > len(c.token_ids)
    _assert_pool_clean(llm)


def test_logprobs_match_transformers(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    ids = llm.get_tokenizer().encode(PROMPT)
    [out] = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    )
    logprobs = out.outputs[0].logprobs
    assert len(logprobs) == 6
    hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_path), dtype=torch.float32).eval()
    with torch.no_grad():
        full = torch.tensor([ids + out.token_ids])
        want = hf(full).logits[0, len(ids) - 1 : -1].log_softmax(-1)
    for j, (tok, entry) in enumerate(zip(out.token_ids, logprobs, strict=True)):
        top = want[j].topk(3)
        assert list(entry) == top.indices.tolist()  # greedy: the sampled token is the top one
        assert entry[tok].rank == 1
        got = torch.tensor([entry[t].logprob for t in top.indices.tolist()])
        torch.testing.assert_close(got, top.values, atol=1e-4, rtol=1e-4)


def test_top_k_minus_one_is_off(llm: LLM) -> None:
    runs = [
        llm.generate(
            PROMPT, SamplingParams(temperature=1.0, seed=3, top_k=k, max_tokens=12, ignore_eos=True)
        )[0]
        for k in (-1, 0)
    ]
    assert runs[0].token_ids == runs[1].token_ids


def test_vllm_keyword_arguments(llm: LLM) -> None:
    assert build_config("tiny-llama", gpu_memory_utilization=0.5).cache.memory_fraction == 0.5
    with pytest.raises(ConfigError, match="same setting"):
        build_config("tiny-llama", gpu_memory_utilization=0.5, memory_fraction=0.4)
    # A bad value is refused under the name the user passed.
    with pytest.raises(ConfigError, match=r"^gpu_memory_utilization must be in \(0, 1\]; got 1.5") as bad:
        LLM("tiny-llama", gpu_memory_utilization=1.5)
    assert "memory_fraction" not in str(bad.value)
    with pytest.raises(ConfigError, match=r"^memory_fraction must be"):
        build_config("tiny-llama", memory_fraction=1.5)
    assert build_config("tiny-llama", dtype="auto", device="cpu").model.dtype == "float32"
    assert llm.get_tokenizer() is llm.engine.tokenizer is not None
    # one request is one sample; generate() fans n out
    with pytest.raises(ConfigError, match="n=2"):
        llm.engine.add_request(PROMPT, SamplingParams(n=2))


def test_cli_accepts_speculative_config_as_an_alias_of_spec() -> None:
    res = CliRunner().invoke(
        app,
        [
            "plan",
            "-m",
            "tiny-llama",
            "--speculative-config",
            '{"method": "eagle3", "num_speculative_tokens": 3}',
            "--json",
            "--num-blocks",
            "64",
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["spec"] == {"method": "eagle3", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama whose tokenizer adds BOS (as Llama's does) and whose chat template writes it."""
    src = resolve_model("tiny-llama")
    dst = tmp_path_factory.mktemp("bos") / "bos-llama"
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in ("tokenizer.json", "chat_template.jinja"):
            os.symlink(f, dst / f.name)
    tok = json.loads((src / "tokenizer.json").read_text())
    bos = json.loads((src / "tokenizer_config.json").read_text())["bos_token"]
    first = [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": first,
        "pair": [*first, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [tok["added_tokens"][0]["id"]], "tokens": [bos]}},
    }
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    (dst / "chat_template.jinja").write_text("{{ bos_token }}" + (src / "chat_template.jinja").read_text())
    return dst


def test_text_prompts_get_bos_as_transformers_encodes_them(bos_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    oracle = AutoTokenizer.from_pretrained(str(bos_model))
    ids = oracle(PROMPT).input_ids
    assert ids[0] == oracle.bos_token_id  # the tokenizer really adds one
    llm = LLM(str(bos_model), device="cpu", max_model_len=64, num_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    [out] = llm.generate(PROMPT, params)
    assert out.prompt_token_ids == ids
    hf = AutoModelForCausalLM.from_pretrained(str(bos_model), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    # NOTE: an explicit mask: BOS and pad share id 0 here, and generate would mask the BOS out.
    prompt = torch.tensor([ids])
    want = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=8,
        min_new_tokens=8,
        pad_token_id=0,
    )
    assert out.token_ids == want[0, len(ids) :].tolist()

    messages = [{"role": "user", "content": "hi"}]
    chat_ids = list(
        oracle.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    assert chat_ids.count(oracle.bos_token_id) == 1
    assert llm.chat(messages, params).prompt_token_ids == chat_ids
    # a template rendered to text already starts with BOS: it keeps exactly one
    rendered = oracle.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert llm.generate(rendered, params)[0].prompt_token_ids == chat_ids
    shutil.rmtree(bos_model.parent, ignore_errors=True)


def test_min_tokens_holds_back_stop_tokens_until_reached(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    ids = llm.get_tokenizer().encode(PROMPT)
    ref = llm.generate(ids, GREEDY)[0].token_ids
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    stop = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[ref[k]])
    [early] = llm.generate(ids, stop)
    assert (early.token_ids, early.finish_reason, early.outputs[0].stop_reason) == (
        ref[: k + 1],
        "stop",
        ref[k],
    )

    held = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[ref[k]], min_tokens=k + 3
    )
    [late] = llm.generate(ids, held)
    assert late.token_ids[:k] == ref[:k] and ref[k] not in late.token_ids[: k + 3]
    # the held-back position takes the model's next best token (transformers as the oracle)
    hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_path), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids + ref[:k]])).logits[0, -1]
    assert logits.topk(2).indices.tolist() == [ref[k], late.token_ids[k]]
    _assert_pool_clean(llm)


def _hf(llm: LLM):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(llm.engine.model_path), dtype=torch.float32).eval()


def test_repetition_penalty_matches_transformers(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8)
    [out] = llm.generate(ids, params)
    hf = _hf(llm)
    hf.generation_config.eos_token_id = None
    want = hf.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=16, repetition_penalty=1.8, pad_token_id=0
    )
    assert out.token_ids == want[0, len(ids) :].tolist()
    assert out.token_ids != llm.generate(ids, GREEDY)[0].token_ids[:16]  # the penalty changed something


def test_presence_and_frequency_penalties_match_a_full_recompute(llm: LLM) -> None:
    """Greedy with vLLM's formula (logit - frequency * count - presence * [count > 0], over output
    tokens only) applied to transformers' logits, recomputed from scratch at every step."""
    ids = llm.get_tokenizer().encode(PROMPT)
    hf = _hf(llm)
    for presence, frequency in ((1.5, 0.0), (0.0, 0.7), (-0.5, 1.2)):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=12,
            ignore_eos=True,
            presence_penalty=presence,
            frequency_penalty=frequency,
        )
        [out] = llm.generate(ids, params)
        generated: list[int] = []
        with torch.no_grad():
            for _ in range(12):
                logits = hf(torch.tensor([ids + generated])).logits[0, -1]
                counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.shape[0])
                logits = logits - frequency * counts - presence * (counts > 0)
                generated.append(int(logits.argmax()))
        assert out.token_ids == generated, (presence, frequency)


def test_speculative_decoding_keeps_every_sampling_setting_exact(llm: LLM) -> None:
    """With a model drafting for itself every verify step carries several rows per request: the
    penalties, min_tokens, logprobs and stop strings of each row must be those of plain decoding."""
    spec = LLM(
        "tiny-llama",
        device="cpu",
        max_model_len=128,
        num_blocks=64,
        block_size=16,
        speculative_config="draft_model:3",
    )
    ids = llm.get_tokenizer().encode(PROMPT)
    ref = llm.generate(ids, GREEDY)[0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.4, logprobs=2),
        SamplingParams(
            temperature=0.0, max_tokens=20, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.3
        ),
        SamplingParams(
            temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[ref.token_ids[1]], min_tokens=6
        ),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=_stop_string(ref.text)),
    ]
    want = llm.generate([ids] * len(params), params)
    got = spec.generate([ids] * len(params), params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    for g, w in zip(got[0].outputs[0].logprobs, want[0].outputs[0].logprobs, strict=True):
        assert list(g) == list(w)
        torch.testing.assert_close(
            torch.tensor([x.logprob for x in g.values()]), torch.tensor([x.logprob for x in w.values()])
        )
    assert spec.engine.spec_metrics.num_accepted_tokens > 0  # drafts were really verified
