"""P/D through the proxy, each a separate process: greedy output and per-position acceptance equal
a standalone server shaped like D; D runs with the serving audit on and its free blocks filled with
NaN; after the run no blocks are held on P or D."""

from __future__ import annotations

import random

import pytest
from pd_servers import transfer_config

from server_procs import cluster
from warmcap.serve.chat import chat_token_ids

pytestmark = pytest.mark.slow

TINY = "tiny-llama"
ENGINE = ["--num-blocks", "96", "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager"]


def _prompts() -> list[list[int]]:
    # Lengths around block edges (16 tokens a block): loads of 0, 1, 2 and more full/partial blocks.
    rng = random.Random(13)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 17, 40, 64)]


@pytest.mark.parametrize("spec", ["eagle:3", "dflash:7", "draft_model:2"])
def test_pd_through_the_proxy_equals_a_standalone_server(spec: str, tmp_path) -> None:
    with cluster(tmp_path) as c:
        # P has D's --spec: its drafter's prompt pass writes the KV D's drafter reads, sent along.
        p = c.serve(
            "P", TINY, "--spec", spec, "--kv-transfer-config", transfer_config("kv_producer"), *ENGINE
        )
        d = c.serve(
            "D",
            TINY,
            "--spec",
            spec,
            "--kv-transfer-config",
            transfer_config("kv_consumer"),
            "--audit-serving",
            "--poison-free-kv",
            *ENGINE,
        )
        s = c.serve("S", TINY, "--spec", spec, "--audit-serving", *ENGINE)
        c.wait_ready(p, d, s)
        proxy = c.proxy(p, d)
        c.wait_ready(proxy)
        for prompt in _prompts():
            kw = {
                "model": TINY,
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "extra_body": {"ignore_eos": True},
            }
            got = proxy.client().completions.create(**kw)
            want = s.client().completions.create(**kw)
            assert got.choices[0].text == want.choices[0].text, f"prompt of {len(prompt)} tokens"
            assert got.usage == want.usage
        stream = proxy.client().completions.create(
            model=TINY,
            prompt=_prompts()[2],
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        want = s.client().completions.create(
            model=TINY, prompt=_prompts()[2], max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        assert streamed == want.choices[0].text
        # Greedy on CPU is deterministic: D drafts and accepts exactly as the standalone server.
        assert d.accepted_per_pos() == s.accepted_per_pos()
        assert sum(d.accepted_per_pos()) > 0 or spec != "draft_model:2"
        # The producer proposed nothing: not one draft was verified there.
        drafts = ("vllm:spec_decode_num_drafts_total", frozenset())
        assert p.metrics()[drafts] == 0 < d.metrics()[drafts]
        # Every D step was audited (a stray write would have failed a request) and nothing is held.
        assert p.kv_usage() == 0 and d.kv_usage() == 0


@pytest.mark.real_model
def test_smollm2_chat_through_the_proxy_has_one_bos_on_p_and_d(tmp_path) -> None:
    from transformers import AutoTokenizer

    from warmcap.models.presets import resolve_model

    model = "smollm2-135m"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    ids = chat_token_ids(tok, [(m["role"], m["content"]) for m in messages], model)
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # One BOS opens the prompt (SmolLM2's BOS also opens each turn: no more than the template wrote).
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    assert ids.count(tok.bos_token_id) == rendered.count(tok.bos_token)
    engine = ["--num-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "2", "--enforce-eager"]
    with cluster(tmp_path) as c:
        p = c.serve("P", model, "--kv-transfer-config", transfer_config("kv_producer"), *engine)
        d = c.serve(
            "D", model, "--kv-transfer-config", transfer_config("kv_consumer"), "--audit-serving", *engine
        )
        s = c.serve("S", model, *engine)
        c.wait_ready(p, d, s)
        proxy = c.proxy(p, d)
        c.wait_ready(proxy)
        # What P computed (its answer to the proxy) has exactly the tokens of the one-BOS rendering.
        prefill = p.client().chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=1,
            temperature=0,
            extra_body={"kv_transfer_params": {"do_remote_decode": True}},
        )
        assert prefill.model_extra["kv_transfer_params"]["remote_num_tokens"] == len(ids)
        got = proxy.client().chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=0
        )
        want = s.client().chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=0
        )
        # D checks P's prompt length against its own, so equal text means one BOS on both.
        assert got.usage.prompt_tokens == len(ids) == want.usage.prompt_tokens
        assert got.choices[0].message.content == want.choices[0].message.content
        assert p.kv_usage(settle_s=130) == 0 and d.kv_usage() == 0
