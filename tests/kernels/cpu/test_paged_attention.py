"""The compiled CPU paged-attention kernel against gather + SDPA (the torch path of the same
backend), its build cache and fallbacks, and the real SmolLM2 through it against transformers."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from paged_metadata import poisoned_step as make_step
from warmcap.errors import ConfigError
from warmcap.kernels.cpu import build, paged_attention
from warmcap.kernels.cpu.paged_attention import (
    ENV,
    MAX_QUERY_LEN,
    KernelInputs,
    PagedAttentionKernel,
    load_paged_attention,
)
from warmcap.runner_v2.attention import torch_paged
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention


def backend(mode: str) -> TorchPagedAttention:
    """A CPU backend built under ``WARMCAP_CPU_ATTENTION=mode`` (the choice is made at construction)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, mode)
        return TorchPagedAttention("cpu")


TORCH = backend("torch")
KERNEL = backend("kernel")


#: The kernel serves any span; the property checks it past the backend's bound too.
SPAN = 16
row = st.tuples(st.integers(0, 70), st.integers(1, SPAN))


@settings(max_examples=80, deadline=None)
@given(
    rows=st.lists(row, min_size=1, max_size=5),
    pad_rows=st.integers(0, 2),
    pad_tokens=st.integers(0, 3),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([64, 80, 8, 16, 32]),
    block_size=st.sampled_from([4, 16]),
    window=st.one_of(st.none(), st.integers(1, 40)),
    share=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_gather_and_sdpa_and_never_reads_unseen_kv(
    rows, pad_rows, pad_tokens, num_kv_heads, group, head_dim, block_size, window, share, threads, seed
):
    q, k, v, cache, meta = make_step(
        seed,
        rows,
        pad_rows=pad_rows,
        pad_tokens=pad_tokens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        window=window,
        share=share,
    )
    scale = head_dim**-0.5
    cache_torch, cache_kernel = cache.clone(), cache.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = TORCH.forward(q, k, v, cache_torch, meta, scale=scale, sliding_window=window)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch_paged, "MAX_QUERY_LEN", SPAN)
            got = KERNEL.forward(q, k, v, cache_kernel, meta, scale=scale, sliding_window=window)
    finally:
        torch.set_num_threads(before)
    assert not got.isnan().any(), "the kernel read a position no query can see (NaN there)"
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    real = meta.query_start_loc[len(rows)]
    assert torch.equal(got[real:], torch.zeros_like(got[real:])), "padded tokens must output zeros"
    assert torch.equal(cache_kernel.nan_to_num(7.0), cache_torch.nan_to_num(7.0)), "same KV writes"


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Grows by one for every call of the kernel."""
    calls: list[int] = []
    real_call = PagedAttentionKernel.__call__

    def spy(self, *args, **kwargs):
        calls.append(1)
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(PagedAttentionKernel, "__call__", spy)
    return calls


def test_steps_past_the_query_bound_keep_sdpa(kernel_calls: list[int]):
    calls = kernel_calls
    q, k, v, cache, meta = small_step(0, [(5, MAX_QUERY_LEN + 1), (20, 1)], num_kv_heads=1)
    KERNEL.forward(q, k, v, cache, meta, scale=0.125)
    assert calls == []
    q, k, v, cache, meta = small_step(0, [(5, MAX_QUERY_LEN), (20, 1)], num_kv_heads=1)
    KERNEL.forward(q, k, v, cache, meta, scale=0.125)
    assert calls == [1]


def graph_shaped(meta, *, columns: int):
    """``meta`` as a graph's static buffers give it (``graphs/capture/static_inputs.py``): the block table
    widened to ``columns`` (zero: the null block), ``max_seq_len`` the whole width, ``graph_bounds``."""
    table = torch.zeros(meta.block_table.shape[0], columns, dtype=torch.int32)
    table[:, : meta.block_table.shape[1]] = meta.block_table
    return dataclasses.replace(
        meta, block_table=table, max_seq_len=columns * meta.block_size, graph_bounds=True
    )


def test_graph_steps_read_pages_in_place_at_any_span(kernel_calls: list[int]):
    """A graph step's metadata holds the static maxima (``max_seq_len = max_model_len``): verify
    queries of 1 + k past the kernel's bound and a prefill chunk still go to the kernel, which
    reads each row's own length, with the eager step's results; the cache past each row is NaN."""
    rows = [(37, MAX_QUERY_LEN + 1), (20, 12), (0, 3), (60, 1)]
    q, k, v, cache, meta = small_step(7, rows, pad_rows=1, pad_tokens=2, window=None)
    want = TORCH.forward(q, k, v, cache.clone(), meta, scale=0.125)
    got = KERNEL.forward(q, k, v, cache.clone(), graph_shaped(meta, columns=512), scale=0.125)
    assert kernel_calls == [1]
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.fixture
def c_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Grows by one for every call into the C kernel (the operator's CPU implementation)."""
    calls: list[int] = []
    real = paged_attention._entry_point

    def spy():
        calls.append(1)
        return real()

    monkeypatch.setattr(paged_attention, "_entry_point", spy)
    return calls


def test_fake_tensors_run_the_kernel_operator_not_the_c_code(kernel_calls: list[int], c_calls: list[int]):
    """The graph-safety check runs the forward on fakes: it must see the kernel's operator (whose
    fake implementation gives the output's shape) and never hand the C code a tensor without data."""
    q, k, v, cache, meta = _step_for_fallback()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(x) for x in (q, k, v, cache)]
    with mode:
        # a backend of its own: its plan cache now holds fakes (graph_safety.py restores the runner's)
        out = backend("kernel").forward(*fakes, meta, scale=0.125)
    assert isinstance(out, FakeTensor) and out.shape == q.shape and out.dtype == q.dtype
    assert kernel_calls == [1] and c_calls == []
    KERNEL.forward(q, k, v, cache, meta, scale=0.125)
    assert kernel_calls == [1, 1] and c_calls == [1]


def test_torch_compile_traces_the_kernel_as_one_operator():
    """fullgraph=True fails on any graph break: the operator (which writes the cache) is traced
    whole, and the compiled call gives the eager bits and the same cache writes."""
    q, k, v, cache, meta = small_step(4, [(20, 1), (33, 2)])
    kernel = load_paged_attention()
    assert kernel is not None
    inputs = KernelInputs.of(meta)
    slots = torch_paged.sink_slots(meta.slot_mapping[: q.shape[0]], cache)

    def step(q, cache, k, v):
        return kernel(q, cache, inputs, scale=0.125, window=None, new_kv=(k, v, slots)) * 2.0

    eager_cache, compiled_cache = cache.clone(), cache.clone()
    want = step(q, eager_cache, k, v)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(q, compiled_cache, k, v)
    assert torch.equal(got, want)
    assert torch.equal(compiled_cache.nan_to_num(7.0), eager_cache.nan_to_num(7.0))


def test_a_params_struct_out_of_step_with_the_header_is_refused(monkeypatch):
    """The Python mirror of ``struct warmcap_pa_params`` is checked against the library's layout
    at load: a mismatch is a clear build error (auto mode falls back), never a misread argument."""
    lib = build.load_library(paged_attention.SOURCE)
    monkeypatch.setattr(paged_attention.Params, "VERSION", paged_attention.Params.VERSION + 1)
    paged_attention._bind.cache_clear()
    try:
        with pytest.raises(build.KernelBuildError, match=r"paged_attention\.h and its Python mirror"):
            paged_attention._bind(lib)
    finally:
        paged_attention._bind.cache_clear()


def test_one_openmp_runtime_is_mapped_after_the_kernel_runs_on_two_threads():
    """The kernel's libgomp.so.1 must resolve to torch's copy: two runtimes would each keep a pool."""
    script = textwrap.dedent(
        """
        import json
        import torch
        from warmcap.kernels.cpu.paged_attention import load_paged_attention
        from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention
        assert load_paged_attention() is not None
        torch.set_num_threads(2)
        torch.randn(256, 256) @ torch.randn(256, 256)
        from test_paged_attention import make_step
        q, k, v, cache, meta = make_step(0, [(30, 1), (40, 1)], pad_rows=0, pad_tokens=0, num_kv_heads=2,
            group=3, head_dim=64, block_size=16, window=None, share=False)
        TorchPagedAttention("cpu").forward(q, k, v, cache, meta, scale=0.125)
        maps = open("/proc/self/maps").read().splitlines()
        print(json.dumps(sorted({line.split()[-1] for line in maps if "gomp" in line})))
        """
    )
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parents[1]), *sys.path])}
    env.pop(ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    libs = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(libs) == 1 and Path(libs[0]).name.startswith("libgomp"), libs
    assert "torch" in libs[0], f"the kernel brought its own OpenMP runtime: {libs}"


@pytest.mark.parametrize("rows", [[(40, 1)], [(30, 1), (45, 2), (12, 1)]])
def test_the_threads_split_the_work_without_changing_a_bit(rows):
    """One row at two threads splits by KV head, three rows split by row; one thread does either in
    one task: every head's arithmetic is the same, so the outputs are equal bit for bit."""
    q, k, v, cache, meta = small_step(5, rows)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(KERNEL.forward(q, k, v, cache.clone(), meta, scale=0.125))
    finally:
        torch.set_num_threads(before)
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])


def test_a_write_slot_outside_the_cache_is_refused_before_anything_is_written():
    q, k, v, cache, meta = small_step(6, [(20, 1), (33, 1)])
    kernel = load_paged_attention()
    assert kernel is not None
    blocks, block_size = cache.shape[1], cache.shape[2]
    slots = torch.tensor([3, blocks * block_size])  # the second is one past the last slot
    before = cache.clone()
    inputs = KernelInputs.of(meta)
    with pytest.raises(RuntimeError, match="a KV write slot outside the cache"):
        kernel(q, cache, inputs, scale=0.125, window=None, new_kv=(k, v, slots))
    assert torch.equal(cache.nan_to_num(7.0), before.nan_to_num(7.0)), "nothing may be written"


def test_the_operator_called_directly_refuses_metadata_the_c_code_would_misread():
    q, _, _, cache, meta = small_step(6, [(20, 1), (33, 1)])
    inputs = KernelInputs.of(meta)
    op = torch.ops.warmcap.paged_attention.default
    with pytest.raises(ValueError, match="block_table must be contiguous int32"):
        op(
            q,
            cache,
            inputs.block_table.long(),
            inputs.seq_lens,
            inputs.query_start_loc,
            0.125,
            0,
            None,
            None,
            None,
        )
    with pytest.raises(ValueError, match="must agree"):
        op(
            q,
            cache,
            inputs.block_table,
            inputs.seq_lens[:1],
            inputs.query_start_loc,
            0.125,
            0,
            None,
            None,
            None,
        )


def small_step(seed: int, rows: list[tuple[int, int]], **overrides: object):
    """:func:`make_step` (``tests/paged_metadata.poisoned_step``) with SmolLM2's head shape per KV head (3 query heads of 64), 2 KV heads,
    16-token pages, no padding, window or shared page unless ``overrides`` say otherwise."""
    options: dict = dict(
        pad_rows=0,
        pad_tokens=0,
        num_kv_heads=2,
        group=3,
        head_dim=64,
        block_size=16,
        window=None,
        share=False,
    )
    return make_step(seed, rows, **{**options, **overrides})


def _step_for_fallback():
    return small_step(3, [(30, 1), (0, 4), (17, 2)], pad_rows=1, pad_tokens=2)


def test_no_compiler_falls_back_to_sdpa_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("WARMCAP_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.delenv(ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="warmcap.attention"):
        fallback = TorchPagedAttention("cpu")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "/nonexistent/cc" in warnings[0].getMessage()
    q, k, v, cache, meta = _step_for_fallback()
    got = fallback.forward(q, k, v, cache.clone(), meta, scale=0.125)
    want = TORCH.forward(q, k, v, cache.clone(), meta, scale=0.125)
    assert torch.equal(got, want)
    monkeypatch.setenv(ENV, "kernel")
    with pytest.raises(ConfigError, match="cannot be built"):
        TorchPagedAttention("cpu")


def test_a_failing_compile_is_reported_with_its_stderr(monkeypatch, tmp_path, caplog):
    cc = tmp_path / "cc"
    cc.write_text(
        '#!/bin/sh\nif [ "$1" = -dumpfullversion ]; then echo 99.0; exit 0; fi\necho "error: no luck" >&2\nexit 1\n'
    )
    cc.chmod(0o755)
    monkeypatch.setenv("WARMCAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.delenv(ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="warmcap.attention"):
        assert load_paged_attention() is None
    assert "error: no luck" in caplog.text
    assert not list((tmp_path / "cache" / "kernels").glob("*.so")), "no half-built library may stay"


def test_the_library_is_built_once_into_the_warmcap_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("WARMCAP_CACHE", str(tmp_path))
    monkeypatch.delenv(ENV, raising=False)
    assert load_paged_attention() is not None
    built = list((tmp_path / "kernels").glob("paged_attention-*.so"))
    assert len(built) == 1
    # A second process finds it: no compile happens (the loaded-library memo is per process).
    monkeypatch.setattr(build, "_loaded", {})

    def no_compile(*_: object) -> None:
        raise AssertionError("compiled again although the library was cached")

    monkeypatch.setattr(build, "_compile", no_compile)
    assert load_paged_attention() is not None
    assert list((tmp_path / "kernels").glob("*.so")) == built


def test_an_unknown_mode_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ConfigError, match="auto, torch, kernel"):
        TorchPagedAttention("cpu")


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_greedy_through_the_kernel_equals_transformers(monkeypatch, kernel_calls):
    from transformers import AutoModelForCausalLM

    from warmcap.llm import LLM
    from warmcap.models.presets import resolve_model
    from warmcap.sampling_params import SamplingParams

    monkeypatch.setenv(ENV, "kernel")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
    llm = LLM("smollm2-135m", device="cpu", max_model_len=128, num_blocks=64, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tok = llm.engine.tokenizer
    ids = [tok(p).input_ids for p in prompts]
    got = [o.token_ids for o in llm.generate(ids, params)]
    assert kernel_calls, "decode steps must run through the kernel"
    ref = AutoModelForCausalLM.from_pretrained(str(resolve_model("smollm2-135m")), dtype=torch.float32).eval()
    for prompt, tokens in zip(ids, got, strict=True):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None)
        assert tokens == out[0, len(prompt) :].tolist()
