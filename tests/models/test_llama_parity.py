"""warmcap's Llama family over paged attention vs transformers on the same weights (I6)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from warmcap.models.loader import load_model
from warmcap.models.tiny import write_tiny_model

PROMPT_LENS = (5, 17, 33)
GEN_TOKENS = 32


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None  # generate exactly GEN_TOKENS, like the harness
    return model.eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    dirs = {}
    for name in ("tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"):
        dirs[name] = root / name
        write_tiny_model(name, dirs[name])
    return dirs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"])
def test_logits_and_greedy_match_transformers(name, tiny_dirs, harness_cls):
    path = tiny_dirs[name]
    ours = load_model(path)
    ref = hf_model(path)
    ps = prompts(ref.config.vocab_size)
    # A padded row with padded tokens rides along every step, as in a graph-padded batch.
    generated, history = harness_cls(ours, seed=3, pad_rows=1, pad_tokens=3).greedy(ps, GEN_TOKENS)
    with torch.no_grad():
        for step in (0, 1, 5):
            for i, p in enumerate(ps):
                full = torch.tensor([p + generated[i][:step]])
                want = ref(full).logits[0, -1]
                assert (history[step][i] - want).abs().max().item() <= 1e-4, (name, step, i)
    for i, p in enumerate(ps):
        assert generated[i] == hf_greedy(ref, p, GEN_TOKENS), (name, i)


def test_mistral_sliding_window_is_exercised(tiny_dirs):
    """The tiny Mistral's window is shorter than prompt + generation, so the window matters."""
    ours = load_model(tiny_dirs["tiny-mistral"])
    specs = ours.kv_layer_specs(16)
    assert {s.kind for s in specs.values()} == {"sliding_window"}
    assert all(s.sliding_window < max(PROMPT_LENS) for s in specs.values())


ROPE_VARIANTS = {
    "linear": ({"rope_type": "linear", "factor": 2.0}, {}),
    # max_position_embeddings 40: decode runs past it, where dynamic NTK starts scaling.
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, {"max_position_embeddings": 40}),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {},
    ),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_variants_match_transformers(variant, tmp_path, harness_cls):
    from transformers import LlamaForCausalLM as HFLlama

    from warmcap.models.tiny import tiny_config

    rope, extra = ROPE_VARIANTS[variant]
    config = tiny_config("tiny-llama", rope_scaling={"rope_theta": 10000.0, **rope}, **extra)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(7)
    HFLlama(config).save_pretrained(str(tmp_path))
    ours, ref = load_model(tmp_path), hf_model(tmp_path)
    ps = [p[:30] for p in prompts(config.vocab_size, seed=1)]
    generated, history = harness_cls(ours).greedy(ps, 16)
    with torch.no_grad():
        for i, p in enumerate(ps):
            want = ref(torch.tensor([p])).logits[0, -1]
            assert (history[0][i] - want).abs().max().item() <= 1e-4
            assert generated[i] == hf_greedy(ref, p, 16), (variant, i)


def test_bf16_loads_and_tracks_transformers_bf16(tiny_dirs, harness_cls):
    path = tiny_dirs["tiny-qwen3"]
    ours = load_model(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ref = hf_model(path, torch.bfloat16)
    ps = prompts(ref.config.vocab_size)
    _, history = harness_cls(ours).greedy(ps, 1)
    assert history[0].dtype == torch.float32
    with torch.no_grad():
        for i, p in enumerate(ps):
            want = ref(torch.tensor([p])).logits[0, -1].float()
            torch.testing.assert_close(history[0][i], want, atol=0.05, rtol=0.05)


def test_aux_hidden_states_are_the_inputs_of_the_listed_layers(tiny_dirs, harness_cls, seq_cls):
    path = tiny_dirs["tiny-qwen3"]
    ours, ref = load_model(path), hf_model(path)
    prompt = prompts(ref.config.vocab_size)[1]
    _, ctx = harness_cls(ours).step([seq_cls([])], [prompt], aux_layers=(2, 0, 1))
    with torch.no_grad():
        hf_states = ref(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    assert len(ctx.aux_hidden_states) == 3
    for got, layer in zip(ctx.aux_hidden_states, (2, 0, 1), strict=True):
        torch.testing.assert_close(got, hf_states[layer][0], atol=1e-5, rtol=1e-5)


def test_tied_embeddings_share_storage(tiny_dirs):
    ours = load_model(tiny_dirs["tiny-qwen2"])
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    untied = load_model(tiny_dirs["tiny-llama"])
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
