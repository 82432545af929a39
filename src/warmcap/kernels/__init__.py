"""Every hand-written kernel of warmcap, below ``models`` and ``runner_v2`` which call them:
:mod:`.cpu` (C sources compiled once per machine, called through ``torch.library`` operators) and
:mod:`.triton` (Triton kernels for CUDA, also run on CPU under ``TRITON_INTERPRET=1``).
docs/architecture.md explains which caller picks which kernel.
"""
