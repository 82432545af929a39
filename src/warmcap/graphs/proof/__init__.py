"""Proof: what start-up says about the captured graphs (invariant I4) — verification replay vs
eager, the CPU check that a graph would record under CUDA, the start-up cache of those verdicts,
and the report (its schema, rendering and diff). Reads :mod:`warmcap.graphs.capture`; capture
never reads it (``tests/test_layers.py``)."""
