"""CUDA graphs: :mod:`~warmcap.graphs.capture` takes them, :mod:`~warmcap.graphs.proof` proves and
reports them, :mod:`~warmcap.graphs.startup` composes the two at start-up (``hook.py``: the
start-up hook). docs/graphs.md."""
