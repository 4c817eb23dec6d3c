"""sglang (HiCache fork): hierarchical KV cache, PD transfer and a small serving engine."""

__version__ = "0.1.0"
