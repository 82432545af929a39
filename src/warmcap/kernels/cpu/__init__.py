"""Compiled CPU kernels: plain C sources built once per machine into the warmcap cache
(:mod:`.build`) and called through ctypes (:mod:`.paged_attention`)."""
