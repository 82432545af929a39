"""``/v1/models``, ``/tokenize`` and ``/detokenize`` in vLLM's shapes, checked against transformers'
tokenizer loaded from the ``root`` the server names (as ``vllm bench serve`` loads it) and against
the ids the generation routes compute for the same prompt."""

from __future__ import annotations

from functools import partial

import httpx
import pytest
from serve_fixtures import running
from transformers import AutoTokenizer

from warmcap.llm import build_config
from warmcap.serve import ServeOptions, build_app
from warmcap.serve.startup_facts import start_engine

MODEL = "tiny-llama"
MAX_MODEL_LEN = 128
ENGINE_KW = {
    "num_blocks": 64,
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 128,
    "enforce_eager": True,
    "device": "cpu",
}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]
#: vLLM's ModelCard and ModelPermission keys (vllm/entrypoints/openai/protocol.py)
CARD_KEYS = {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
PERMISSION_KEYS = {
    "id",
    "object",
    "created",
    "allow_create_engine",
    "allow_sampling",
    "allow_logprobs",
    "allow_search_indices",
    "allow_view",
    "allow_fine_tuning",
    "organization",
    "group",
    "is_blocking",
}


@pytest.fixture(scope="module")
def server():
    config = build_config(MODEL, **ENGINE_KW)
    with running(build_app(config, ServeOptions(), start=partial(start_engine, config))) as srv:
        srv.wait_ready()
        yield srv


@pytest.fixture(scope="module")
def hf_tokenizer(server):
    """transformers' tokenizer from the card's ``root``, as a benchmark client loads it."""
    root = httpx.get(server.base_url + "/v1/models").json()["data"][0]["root"]
    return AutoTokenizer.from_pretrained(root, local_files_only=True)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_model_card_has_vllm_fields_and_a_root_transformers_loads(server, hf_tokenizer) -> None:
    body = httpx.get(server.base_url + "/v1/models").json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert set(card) == CARD_KEYS
    assert card["id"] == MODEL and card["object"] == "model" and isinstance(card["created"], int)
    assert card["parent"] is None and card["max_model_len"] == MAX_MODEL_LEN
    assert card["root"] == str(server.state.loop.engine.model_path)
    assert [set(p) for p in card["permission"]] == [PERMISSION_KEYS]
    assert card["permission"][0]["object"] == "model_permission"
    # the openai client reads the same list, and the root's tokenizer is the engine's
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    assert hf_tokenizer.encode("Hello there") == server.state.loop.engine.encode("Hello there")


def test_tokenize_prompt_gives_the_ids_a_completion_computes(server, hf_tokenizer) -> None:
    prompt = "The quick brown fox jumps"
    got = _post(server, "/tokenize", {"model": MODEL, "prompt": prompt, "return_token_strs": True}).json()
    completion = _post(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "return_token_ids": True},
    ).json()
    assert got["tokens"] == completion["choices"][0]["prompt_token_ids"]
    assert got["tokens"] == hf_tokenizer(prompt)["input_ids"]
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == MAX_MODEL_LEN
    assert got["token_strs"] == hf_tokenizer.convert_ids_to_tokens(got["tokens"])
    plain = _post(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()
    assert plain["tokens"] == hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert plain["token_strs"] is None
    assert _post(server, "/tokenize", {"prompt": ""}).json()["count"] == len(hf_tokenizer("")["input_ids"])


def test_tokenize_messages_gives_the_ids_a_chat_completion_computes(server, hf_tokenizer) -> None:
    got = _post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()
    chat = _post(
        server,
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "temperature": 0, "return_token_ids": True},
    ).json()
    assert got["tokens"] == chat["prompt_token_ids"]
    assert got["count"] == len(got["tokens"])
    open_ended = _post(
        server,
        "/tokenize",
        {"messages": MESSAGES, "add_generation_prompt": False, "continue_final_message": True},
    ).json()
    text = hf_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert open_ended["tokens"] == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert open_ended["tokens"] != got["tokens"]


def test_detokenize_decodes_as_transformers_and_round_trips(server, hf_tokenizer) -> None:
    prompt = "Paris is the capital of France."
    ids = _post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    got = _post(server, "/detokenize", {"model": MODEL, "tokens": ids}).json()
    assert got == {"prompt": hf_tokenizer.decode(ids)}
    plain = _post(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    assert _post(server, "/detokenize", {"tokens": plain}).json()["prompt"] == prompt


@pytest.mark.parametrize(
    ("path", "body", "param", "needle"),
    [
        ("/tokenize", {"model": MODEL}, "prompt", "prompt"),
        ("/tokenize", {"prompt": "hi", "chat_template": "{{ x }}"}, "chat_template", "chat_template"),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": "maybe"}, "add_special_tokens", "bool"),
        (
            "/tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            "continue_final_message",
            "add_generation_prompt",
        ),
        ("/tokenize", {"prompt": "word " * (2 * MAX_MODEL_LEN)}, "prompt", f"max_model_len {MAX_MODEL_LEN}"),
        ("/detokenize", {"tokens": [1, 2, 10**9]}, "tokens", "token id 1000000000 at position 2"),
        ("/detokenize", {"tokens": [-1]}, "tokens", "token id -1 at position 0"),
        ("/detokenize", {"tokens": "abc"}, "tokens", "tokens"),
    ],
)
def test_bad_input_is_400_with_the_openai_error_body(server, path, body, param, needle) -> None:
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert needle in error["message"]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_a_model_this_server_does_not_serve_is_404(server, path) -> None:
    body = {"model": "gpt-4", "prompt": "hi"} if path == "/tokenize" else {"model": "gpt-4", "tokens": [1]}
    r = _post(server, path, body)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
