"""Benchmarks: the pipeline by stage next to diffusers, and its parts (attention, transformer, loading, ...)."""
