"""The random tiny pipeline (`WanPipeline.tiny(random=True)`), one per test module that asks for it
(test_forward.py, test_spec.py)."""

import pytest

from pipelines import WanPipeline


@pytest.fixture(scope="module")
def tiny():
  return WanPipeline.tiny(random=True)
