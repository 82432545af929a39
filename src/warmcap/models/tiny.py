"""Tiny random-weight presets: deterministic HF checkpoints + an offline-trained BPE tokenizer.

Small enough to build in about a second; used by tests and as parity targets against transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CORPUS = """\
The quick brown fox jumps over the lazy dog. A warm cup of tea sits on the kitchen table.
Once upon a time there was a small village at the edge of a great forest. The people of the
village grew wheat and barley, kept goats and bees, and told stories by the fire every night.
The capital of France is Paris. The capital of Italy is Rome. The capital of Japan is Tokyo.
Water boils at one hundred degrees at sea level and freezes at zero. The sun rises in the east.
She opened the window, looked at the rain, and decided to stay home and read a book about ships.
Numbers: one two three four five six seven eight nine ten eleven twelve. Colors: red green blue.
The model reads the prompt, writes one token at a time, and stops when it reaches the end.
Please answer the question clearly and briefly. Thank you for your help with the garden today.
"""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 512
SEED = 1234

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    # Larger than HF's 0.02 so logits are peaked and greedy choices are not near-ties.
    "initializer_range": 0.1,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}

#: preset name -> (transformers config class, overrides)
TINY_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("LlamaConfig", {"num_hidden_layers": 2, "tie_word_embeddings": False}),
    "tiny-mistral": ("MistralConfig", {"num_hidden_layers": 2, "head_dim": 16, "sliding_window": 24}),
    "tiny-qwen2": ("Qwen2Config", {"num_hidden_layers": 2, "tie_word_embeddings": True}),
    "tiny-qwen3": ("Qwen3Config", {"num_hidden_layers": 3, "head_dim": 16, "tie_word_embeddings": True}),
}


def tiny_config(name: str, **overrides: Any) -> Any:
    """The transformers config of tiny preset ``name`` (``overrides`` replace preset values)."""
    import transformers

    class_name, preset = TINY_PRESETS[name]
    return getattr(transformers, class_name)(**{**_COMMON, **preset, **overrides})


def write_tokenizer(out_dir: Path) -> None:
    """Train a byte-level BPE on :data:`CORPUS` (deterministic) and save it for ``AutoTokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out_dir))


def write_tiny_model(name: str, out_dir: Path, *, config_only: bool = False) -> None:
    """Write tiny preset ``name`` into ``out_dir``: config (+ seeded random weights and tokenizer)."""
    config = tiny_config(name)
    config.architectures = [TINY_PRESETS[name][0].replace("Config", "ForCausalLM")]
    if config_only:
        config.save_pretrained(str(out_dir))
        return
    import torch
    import transformers

    torch.manual_seed(SEED)
    model = getattr(transformers, config.architectures[0])(config)
    model.save_pretrained(str(out_dir))
    write_tokenizer(out_dir)
