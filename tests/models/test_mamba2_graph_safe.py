"""The Mamba2 mixer's uniform path (every row the same small query length: decode, spec verify,
uniform graphs) against its per-row ragged path, and a proof on CPU that only the uniform path can
run inside a CUDA graph (no host read of device data)."""

from __future__ import annotations

import dataclasses
import itertools
from math import prod

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.func import functional_call

from warmcap.contracts.backends import MAX_UNIFORM_QUERY_LEN
from warmcap.contracts.metadata import MambaMetadata
from warmcap.models.loader import load_model
from warmcap.models.mamba2 import Mamba2Mixer
from warmcap.models.packed_linear import running_unpacked
from warmcap.models.presets import resolve_model
from warmcap.runner_v2.attention.context import StepContext
from warmcap.runner_v2.attention.selector import backend_registry
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention

NUM_BLOCKS = 16
SINK = NUM_BLOCKS
GROUP = "mamba"
_ = -1  # no block: zero state for a read, nothing stored for a write

# (query length, read block per row, write block per token). Rows are requests of one step.
CASES = {
    # k = 2 verify rows: row 0 reads and rewrites block 5 (mode none); row 1 reads block 6, which
    # row 0 writes in the same step (reads come first); row 2 is new; row 3 is padding.
    "spec_verify": (3, [5, 6, _, _], [5, 6, 7, 10, 11, 12, _, _, 13, _, _, _]),
    "decode": (1, [1, 2, _, _, 3], [1, 2, 4, _, 8]),
    # Mode ``all`` chunks: states at a block boundary mid-chunk and at the chunk's end.
    "all_mode_chunk": (
        8,
        [4, _, 9, _],
        [*[_, _, _, 1, _, _, _, 2], *[_, _, _, 3, _, _, _, 5], *[_] * 7, 14, *[_] * 8],
    ),
    "threshold": (
        MAX_UNIFORM_QUERY_LEN,
        [4, _, 9],
        [*[_] * 3, 1, *[_] * 11, 2, *[_] * 3, 3, *[_] * 11, 5, *[_] * 15, 14],
    ),
}
# The ragged path steps token by token only where every token stores a state; elsewhere it runs the
# chunked SSD form, equal to the recurrence up to float rounding.
BIT_EQUAL = {"spec_verify": False, "decode": True, "all_mode_chunk": False, "threshold": False}


@pytest.fixture(scope="module")
def mixer() -> Mamba2Mixer:
    model = load_model(resolve_model("tiny-hybrid"))
    layer = model.model.layers[0].mamba
    assert isinstance(layer, Mamba2Mixer)
    return layer


def metadata(reads: list[int], writes: list[int], lens: list[int], *, max_query_len: int) -> MambaMetadata:
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    seq_lens = torch.tensor([n + 7 for n in lens], dtype=torch.int32)
    return MambaMetadata(
        num_tokens=int(qsl[-1]),
        num_reqs=len(lens),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_table=torch.zeros(len(lens), 1, dtype=torch.int32),
        slot_mapping=torch.full((int(qsl[-1]),), -1, dtype=torch.int64),
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max()),
        block_size=4,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        read_blocks=torch.tensor(reads, dtype=torch.int64),
        write_blocks=torch.tensor(writes, dtype=torch.int64),
    )


def random_states(mixer: Mamba2Mixer, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    states = torch.randn(NUM_BLOCKS + 1, sum(prod(s) for s in mixer.state_shapes), generator=gen)
    # A -1 read must start from zero whatever the null block holds.
    states[0] = float("nan")
    return states


def run(mixer: Mamba2Mixer, meta: MambaMetadata, states: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ctx = StepContext(
        {GROUP: meta},
        {mixer.layer_name: GROUP},
        {mixer.layer_name: states},
        backend_registry(TorchPagedAttention()),
        {GROUP: "mamba"},
    )
    with torch.no_grad():
        return mixer(x, ctx)


def inputs(mixer: Mamba2Mixer, num_tokens: int, seed: int) -> torch.Tensor:
    hidden = mixer.in_proj.in_features
    return torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES)
def test_uniform_rows_match_the_per_row_path(mixer: Mamba2Mixer, case: str) -> None:
    q, reads, writes = CASES[case]
    lens = [q] * len(reads)
    x = inputs(mixer, len(writes), seed=1)
    before = random_states(mixer, seed=2)
    uniform_states, ragged_states = before.clone(), before.clone()
    uniform = run(mixer, metadata(reads, writes, lens, max_query_len=q), uniform_states, x)
    # The same rows declared with a larger maximum query length take the per-row path.
    ragged = run(mixer, metadata(reads, writes, lens, max_query_len=q + 1), ragged_states, x)

    assert torch.isfinite(uniform).all()
    tol = 0.0 if BIT_EQUAL[case] else 2e-6
    diff = (uniform - ragged).abs().max().item()
    assert diff <= tol, f"{case}: max |uniform - per-row| {diff}"
    real = slice(1, NUM_BLOCKS)  # block 0 holds NaN; the sink (the last row) is scratch
    state_diff = (uniform_states[real] - ragged_states[real]).abs().max().item()
    assert state_diff <= tol, f"{case}: stored states differ by {state_diff}"
    stored = {b for b in writes if b >= 0}
    untouched = [b for b in range(1, NUM_BLOCKS) if b not in stored]
    assert torch.equal(uniform_states[untouched], before[untouched])
    assert torch.isnan(uniform_states[0]).all()  # the null block is never written
    assert all(not torch.equal(uniform_states[b], before[b]) for b in stored)


def test_padded_rows_change_no_real_output_or_state(mixer: Mamba2Mixer) -> None:
    q, reads, writes = CASES["spec_verify"]
    real_rows = 3
    x = inputs(mixer, len(writes), seed=3)
    before = random_states(mixer, seed=4)
    padded_states, real_states = before.clone(), before.clone()
    padded = run(mixer, metadata(reads, writes, [q] * len(reads), max_query_len=q), padded_states, x)
    alone = run(
        mixer,
        metadata(reads[:real_rows], writes[: real_rows * q], [q] * real_rows, max_query_len=q),
        real_states,
        x[: real_rows * q],
    )
    # Not bit-equal: the projections are matrix products over 12 rows instead of 9, which may
    # round differently; a leak from a padded row would be of the order of the values themselves.
    torch.testing.assert_close(padded[: real_rows * q], alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(padded_states[:SINK], real_states[:SINK], rtol=0, atol=1e-5, equal_nan=True)


def fake_forward(
    mixer: Mamba2Mixer, meta: MambaMetadata, states: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """The mixer's forward with every tensor (weights included) fake: data-dependent ops and host
    reads of tensor values raise, as they would fail inside a CUDA graph capture."""
    mode = FakeTensorMode()
    params = {
        name: mode.from_tensor(t)
        for name, t in itertools.chain(mixer.named_parameters(), mixer.named_buffers())
    }
    fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    fake_meta = MambaMetadata(
        **{k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    )
    ctx = StepContext(
        {GROUP: fake_meta},
        {mixer.layer_name: GROUP},
        {mixer.layer_name: mode.from_tensor(states)},
        backend_registry(TorchPagedAttention()),
        {GROUP: "mamba"},
    )
    # the packed copy of a CPU linear's weight is no parameter: run the linears on the fake ones
    with running_unpacked(mixer.modules()), mode, torch.no_grad():
        return functional_call(mixer, params, (mode.from_tensor(x), ctx))


@pytest.mark.parametrize("case", ["spec_verify", "decode", "threshold"])
def test_uniform_path_runs_without_reading_device_data(mixer: Mamba2Mixer, case: str) -> None:
    q, reads, writes = CASES[case]
    meta = metadata(reads, writes, [q] * len(reads), max_query_len=q)
    out = fake_forward(mixer, meta, random_states(mixer, seed=5), inputs(mixer, len(writes), seed=6))
    assert out.shape == (len(writes), mixer.out_proj.out_features)


def test_ragged_and_long_rows_read_device_data(mixer: Mamba2Mixer) -> None:
    """Negative controls: the per-row path reads its row bounds and blocks on the host."""
    states = random_states(mixer, seed=7)
    ragged = metadata([1, _], [2, _, 3], [1, 2], max_query_len=2)
    with pytest.raises(DataDependentOutputException):
        fake_forward(mixer, ragged, states, inputs(mixer, 3, seed=8))
    q = MAX_UNIFORM_QUERY_LEN + 1
    long_rows = metadata([1], [*[_] * (q - 1), 2], [q], max_query_len=q)
    with pytest.raises(DataDependentOutputException):
        fake_forward(mixer, long_rows, states, inputs(mixer, q, seed=9))
