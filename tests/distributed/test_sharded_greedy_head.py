"""The screened greedy head under tensor parallelism (``models/greedy_head.py`` ``ShardedGreedyHead``):
each rank screens its slice of the vocabulary and the ranks exchange one (logit, id) pair a row. Its
argmax must be the full logits' ``row_argmax`` on every rank (ties to the lowest id, across ranks
too), and the ranks must fall back to the full logits together whenever any one of them cannot
answer, or the collectives that follow would part ways."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tp_ranks import sharded_head_argmax

from warmcap.distributed import rendezvous_for, run_on_ranks
from warmcap.models.loader import load_model
from warmcap.models.presets import resolve_model
from warmcap.runner_v2.sampler import row_argmax

pytestmark = pytest.mark.usefixtures("screen_on_every_cpu")

HEAD = "lm_head.weight"


def _tied_across_shards(out: Path) -> tuple[Path, int, int]:
    """tiny-llama with LM-head row ``a`` (in rank 0's half) made the longest and copied to row ``b``
    (in rank 1's half): a row along it has equal largest logits on both ranks."""
    src = Path(resolve_model("tiny-llama"))
    shutil.copytree(src, out, dirs_exist_ok=True)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    tensors = load_file(str(src / "model.safetensors"))
    w = tensors[HEAD].clone()
    a, b = 5, vocab // 2 + 5
    w[a] *= 4 * w.norm(dim=1).max() / w[a].norm()
    w[b] = w[a]
    tensors[HEAD] = w
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, a, b


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    return _tied_across_shards(tmp_path_factory.mktemp("tied_head"))


@pytest.mark.slow
def test_the_sharded_screen_gives_the_full_argmax_on_every_rank_ties_to_the_lowest_id(tied_model):
    model_dir, a, b = tied_model
    one = load_model(str(model_dir))
    w = one.lm_head.weight.detach()
    g = torch.Generator().manual_seed(3)
    rows = torch.cat([torch.randn(10, w.shape[1], generator=g) * 4, w[a : a + 1], 2 * w[a : a + 1]])
    reference = row_argmax(one.compute_logits(rows))
    # the tie is real: rows along w[a] score a and b alike, and TP=1 takes a (the first maximum)
    logits = one.compute_logits(rows[-2:])
    assert torch.equal(logits[:, a], logits[:, b]) and reference[-2:].tolist() == [a, a]

    ranks = run_on_ranks(sharded_head_argmax, rendezvous_for(2), str(model_dir), rows, timeout_s=120)
    assert [r["vocab_start"] for r in ranks] == [0, w.shape[0] // 2]
    for r in ranks:
        assert r["screens"], "the screen was not built on a rank"
        assert r["screened"] is not None, "the screen declined random rows"
        assert torch.equal(r["screened"], r["full"])
        assert torch.equal(r["screened"], reference)
        # one rank declining sends every rank to the full logits
        assert r["declined"] is None
        # a rank that cannot screen turns the head off on every rank, after one exchange
        assert r["without"] == [None, None] and r["off"]
