"""A Llama-family checkpoint whose KV groups are padded so a tensor-parallel size divides its heads,
computing exactly the function of the original.

vLLM refuses ``tensor_parallel_size=2`` for SmolLM2-135M (9 attention heads, 3 KV heads: "Total
number of attention heads (9) must be divisible by tensor parallel size (2)"), so its TP=2 cannot be
run on the shared model. This writes a sibling model with ``--kv-heads`` KV groups (SmolLM2: 4, so
12 query heads) that both engines shard evenly: each added group copies the last real group's
q/k/v rows (ordinary values, so no kernel meets a degenerate input), and its columns of ``o_proj``
are zero, so the added heads contribute exactly 0 to every layer's output. The padded model's
logits equal the original's up to the summation order of ``o_proj``'s wider product, and greedy
tokens are the original's (``--check`` compares transformers' greedy tokens of both). It costs more:
a padded group's q/k/v/o products and attention are computed and thrown away, about 8 % more work
a token on SmolLM2 (4/3 of the attention's linears, MLP unchanged), in every engine alike.

    .venv/bin/python benchmarks/pad_heads.py [--model smollm2-135m] [--kv-heads 4] [--out DIR] [--check]

Prints the directory written (default: ``<model dir>-kv<N>`` beside the converted model).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def pad_checkpoint(src: Path, dst: Path, kv_heads: int) -> Path:
    config = json.loads((src / "config.json").read_text())
    heads, kv = (
        config["num_attention_heads"],
        config.get("num_key_value_heads") or config["num_attention_heads"],
    )
    hd = config.get("head_dim") or config["hidden_size"] // heads
    if kv_heads < kv:
        raise SystemExit(f"--kv-heads {kv_heads} is fewer than the model's {kv} KV heads: give at least {kv}")
    group = heads // kv
    extra = kv_heads - kv
    tensors = load_file(str(src / "model.safetensors"))
    padded: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("self_attn.q_proj.weight"):
            last = t[-group * hd :]
            t = torch.cat([t, *([last] * extra)])
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            last = t[-hd:]
            t = torch.cat([t, *([last] * extra)])
        elif name.endswith("self_attn.o_proj.weight"):
            t = torch.cat([t, t.new_zeros(t.shape[0], extra * group * hd)], dim=1)
        elif (
            "self_attn" in name
            and name.endswith(".bias")
            and ("q_proj" in name or "k_proj" in name or "v_proj" in name)
        ):
            width = group * hd if "q_proj" in name else hd
            t = torch.cat([t, *([t[-width:]] * extra)])
        padded[name] = t.contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name not in ("config.json", "model.safetensors") and item.is_file():
            shutil.copy2(item, dst / item.name)
    config.update(num_attention_heads=group * kv_heads, num_key_value_heads=kv_heads, head_dim=hd)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(padded, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def check(src: Path, dst: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    outs = []
    for path in (src, dst):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        outs.append(model.generate(ids, max_new_tokens=24, do_sample=False)[0].tolist())
    if outs[0] != outs[1]:
        raise SystemExit(f"padded model's greedy tokens differ from the original's:\n{outs[0]}\n{outs[1]}")
    print(f"greedy tokens equal ({len(outs[0]) - ids.shape[1]} new): {tok.decode(outs[0][ids.shape[1] :])!r}")


def padded_model(model: str, kv_heads: int = 4) -> Path:
    """The padded sibling of ``model`` (a preset or directory), written on first use."""
    from warmcap.models.presets import resolve_model_path

    src = Path(resolve_model_path(model))
    dst = src.with_name(f"{src.name}-kv{kv_heads}")
    if not (dst / "model.safetensors").is_file():
        pad_checkpoint(src, dst, kv_heads)
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m", help="preset name or HF directory")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--check", action="store_true", help="compare transformers' greedy tokens of both")
    args = parser.parse_args()
    from warmcap.models.presets import resolve_model_path

    src = Path(resolve_model_path(args.model))
    if args.out is None:
        dst = padded_model(args.model, args.kv_heads)
    else:
        dst = args.out
        if not (dst / "model.safetensors").is_file():
            pad_checkpoint(src, dst, args.kv_heads)
    if args.check:
        check(src, dst)
    print(dst)


if __name__ == "__main__":
    main()
