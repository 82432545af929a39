"""Development instruments, never imported by the runtime: :mod:`.device_check` (the GPU checks
``scripts/gpu_check.py`` runs; they patch runner attributes and set environment switches) and
:mod:`.op_count` (a profiler that wraps backends to count ops per decode step). Scripts,
benchmarks and tests import them; ``tests/test_layers.py`` keeps everything else off them.
"""
