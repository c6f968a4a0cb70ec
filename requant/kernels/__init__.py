"""Triton kernels (need the optional `triton` dependency)."""
