"""Triton kernels: :mod:`.layer_ops` (RMSNorm, SiLU-and-multiply, RoPE with the KV write, greedy
argmax; called by ``models/fused_ops.py``), :mod:`.paged_attention` (the Triton paged-attention
backend and its KV write; picked by ``runner_v2/attention/selector.py``) and :mod:`.slot_mapping`
(the slot-mapping kernel; called by ``runner_v2/slot_mapping.py``). Each is imported lazily by its
caller, so importing warmcap never imports triton.
"""
