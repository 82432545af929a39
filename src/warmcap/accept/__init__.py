"""``warmup accept``: speculative acceptance on a fixed prompt set against a stored baseline.

An application of :class:`~warmcap.llm.LLM` (and of a server's ``/metrics``), so it sits above
``llm.py`` beside ``cli`` and ``serve``; only the CLI imports it. :mod:`.harness` runs the prompt set
(``data/accept_prompts.jsonl``), :mod:`.counters` reads vLLM's spec-decode counters,
:mod:`.baseline` stores and compares (``baselines/``), :mod:`.view` renders. docs/speculative.md.
"""
