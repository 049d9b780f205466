"""Wan text-to-video in JAX: models under `pipelines.wan`, the pipeline, and the `generate` command."""

from pipelines.pipeline import GenerationResult, WanPipeline

__all__ = ["GenerationResult", "WanPipeline"]
