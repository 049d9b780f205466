"""The versions a sidecar records (pipelines/commands/versions.py)."""

from __future__ import annotations

import platform
from importlib import metadata

from pipelines.commands.versions import versions


def test_versions_name_python_and_the_installed_packages():
  found = versions()
  assert found["python"] == platform.python_version()
  assert found["jax"] == metadata.version("jax") and found["numpy"] == metadata.version("numpy")
  assert set(found) == {"python", "wan-usp-jax", "jax", "jaxlib", "flax", "numpy", "imageio-ffmpeg", "transformers"}
