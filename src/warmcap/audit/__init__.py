"""The KV-write audits: :mod:`.kv_writes` checks recorded slot writes against the blocks each
request holds (used by warmup, I2); :mod:`.serving` runs the same check on live serving steps.

They read the runner's write records and the KV manager's block tables, so they sit above
``core`` and ``runner_v2`` and below ``warmup``, ``graphs`` and the engine, which call them.
"""
