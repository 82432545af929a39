"""SmolLM2-135M behind the server: greedy completions and chat equal offline ``LLM``; one BOS."""

from __future__ import annotations

import pytest
from serve_fixtures import running

from warmcap.config import StartupOptions
from warmcap.llm import LLM, build_config
from warmcap.sampling_params import SamplingParams
from warmcap.serve import ServeOptions, build_app
from warmcap.serve.chat import chat_token_ids

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

MODEL = "smollm2-135m"
ENGINE_KW = {"num_blocks": 64, "max_model_len": 256, "max_num_seqs": 4, "device": "cpu"}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_greedy_completions_and_chat_equal_offline() -> None:
    offline = LLM(MODEL, enforce_eager=True, **ENGINE_KW)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    want = offline.generate(prompts, greedy)
    want_chat = offline.chat(MESSAGES, greedy)

    tok = offline.tokenizer
    ids = chat_token_ids(tok, [(m["role"], m["content"]) for m in MESSAGES], MODEL)
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    # Exactly one BOS opens the prompt, and no BOS appears beyond those the template wrote.
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    assert ids.count(tok.bos_token_id) == rendered.count(tok.bos_token)
    assert ids == want_chat.prompt_token_ids

    config = build_config(MODEL, **ENGINE_KW)
    with running(build_app(config, ServeOptions(startup=StartupOptions(capture_sizes=(1, 2))))) as srv:
        srv.wait_ready()
        client = srv.client()
        got = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0)
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [w.text for w in want]
        assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
        assert chat.choices[0].message.content == want_chat.text
        assert chat.usage.prompt_tokens == len(ids)
        stream = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream) == want_chat.text
