"""The versions an output's sidecar records (`versions`): Python's and those of the packages that
make the video; both commands write them (`generate`'s sidecar, each `serve` job's). Imports no JAX.
"""

from __future__ import annotations

import platform


def versions() -> dict[str, str]:
  """The versions of Python and the packages that make the video, for the sidecar."""
  from importlib import metadata
  out = {"python": platform.python_version()}
  for name in ("wan-usp-jax", "jax", "jaxlib", "flax", "numpy", "imageio-ffmpeg", "transformers"):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = "not installed"
  return out
