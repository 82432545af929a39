"""Scheduling core: KV specs, the reservation rule, block pool, KV cache manager, scheduler.

Nothing in this package imports torch.
"""
