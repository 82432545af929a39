"""Attention backends behind the :mod:`warmcap.runner_v2.attention.base` contract."""
