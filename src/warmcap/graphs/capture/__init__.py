"""Capture: which graphs to take (sizes, planning, descriptors), what they record (subjects over
static inputs), taking them (:mod:`~warmcap.graphs.capture.capturer`) and picking one per step
(:mod:`~warmcap.graphs.capture.graph_runner`). Imports nothing from :mod:`warmcap.graphs.proof`
(``tests/test_layers.py``)."""
