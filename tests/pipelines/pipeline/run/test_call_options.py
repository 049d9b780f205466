"""Tests for pipelines/pipeline/run/call_options.py: the call's arguments read from
`GenerationRequest.build`'s signature, each documented once in `CALL_DOCS`."""

from __future__ import annotations

import inspect

import pytest

from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.pipeline.run import call_options
from pipelines.pipeline.wan_pipeline import WanPipeline


def test_every_call_argument_is_documented_once():
  """Every argument of `build` and of `__call__` has one `CALL_DOCS` entry, and every entry names a
  real argument (a renamed or removed one leaves no stale line)."""
  built = set(inspect.signature(GenerationRequest.build).parameters) - {"cls", "model", "video_to_video"}
  called = set(inspect.signature(WanPipeline.__call__).parameters) - {"self", "options"}
  assert set(call_options.REQUEST_ARGUMENTS) == built - {"prompt", "negative_prompt"}
  documented = [name for key in call_options.CALL_DOCS for name in key.split(", ")]
  assert len(documented) == len(set(documented)), sorted(n for n in documented if documented.count(n) > 1)
  assert set(documented) == built | called, (sorted((built | called) - set(documented)),
                                             sorted(set(documented) - built - called))
  assert call_options.call_doc("width") == call_options.CALL_DOCS["height, width"]
  with pytest.raises(KeyError, match="'no_such_argument'"):
    call_options.call_doc("no_such_argument")
