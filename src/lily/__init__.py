"""Lily: Qwen3.6-35B-A3B on Apple silicon through hand-written Metal kernels."""

__version__ = "0.1.0"
