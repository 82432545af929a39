"""Each kernel setting of the config (``config.KernelConfig``) is honoured by the engine it builds:
given to ``LLM(...)`` (or a command's ``--flag``) it decides which kernels the loaded model and its
attention run, over whatever its environment variable says. (Without a C compiler a ``kernel``
setting fails start-up instead: ``tests/kernels/cpu/test_switches.py``.)"""

from __future__ import annotations

from typing import Any

import pytest

from warmcap.errors import ConfigError
from warmcap.kernels.cpu.build import selected_isa, use_isa
from warmcap.llm import LLM
from warmcap.models.packed_linear import PackedLinear

SMALL: dict[str, Any] = {"max_num_seqs": 2, "max_model_len": 128, "num_blocks": 32, "enforce_eager": True}


def _kernels(llm: LLM) -> dict[str, bool]:
    """Which compiled CPU kernels the engine's model and attention hold."""
    model = llm.engine.runner.model
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    return {
        "gemm": any(m.gemm is not None for m in packed),
        "layer_ops": any(getattr(m, "cpu_ops", None) is not None for m in model.modules()),
        "attention": llm.engine.runner.attn_backend._cpu_kernel() is not None,
        "greedy_head": llm.engine.runner.greedy_head is not None,
    }


def test_torch_settings_keep_every_compiled_kernel_out(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("WARMCAP_CPU_GEMM", "WARMCAP_CPU_LAYER_OPS", "WARMCAP_CPU_ATTENTION"):
        monkeypatch.setenv(variable, "kernel")  # the options below win over their variables
    monkeypatch.setenv("WARMCAP_EXACT_GREEDY_HEAD", "portable")
    llm = LLM(
        "tiny-llama",
        cpu_gemm="torch",
        cpu_layer_ops="torch",
        cpu_attention="torch",
        exact_greedy_head="off",
        **SMALL,
    )
    try:
        assert _kernels(llm) == {"gemm": False, "layer_ops": False, "attention": False, "greedy_head": False}
        assert llm.engine.config.kernel.cpu_gemm == "torch"
    finally:
        llm.shutdown()


def test_kernel_settings_attach_every_compiled_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("WARMCAP_CPU_GEMM", "WARMCAP_CPU_LAYER_OPS", "WARMCAP_CPU_ATTENTION"):
        monkeypatch.setenv(variable, "torch")
    llm = LLM(
        "tiny-llama",
        cpu_gemm="kernel",
        cpu_layer_ops="kernel",
        cpu_attention="kernel",
        exact_greedy_head="portable",
        **SMALL,
    )
    try:
        assert _kernels(llm) == {"gemm": True, "layer_ops": True, "attention": True, "greedy_head": True}
        assert llm.engine.runner.greedy_head.portable
    finally:
        llm.shutdown()


def test_bad_kernel_settings_are_refused_with_the_choices() -> None:
    with pytest.raises(ConfigError, match="cpu_attention 'fast' is not one of auto, torch, kernel"):
        LLM("tiny-llama", cpu_attention="fast", **SMALL)


def test_a_second_isa_in_one_process_is_refused() -> None:
    """A process holds one build of each kernel: an engine asking for another ISA after kernels
    were loaded is refused with the way out, never silently run on the first build."""
    llm = LLM("tiny-llama", cpu_gemm="kernel", **SMALL)
    llm.shutdown()
    other = "baseline" if selected_isa() != "baseline" else "avx2"
    with pytest.raises(ConfigError, match=f"cpu_isa '{other}'.*new process"):
        use_isa(other)
    with pytest.raises(ConfigError, match=f"cpu_isa '{other}'.*new process"):
        LLM("tiny-llama", cpu_isa=other, **SMALL)
    use_isa(selected_isa())  # the ISA in force is always accepted
