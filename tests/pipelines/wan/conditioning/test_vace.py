"""Tests for pipelines/wan/conditioning/vace.py and the preprocessing in pipelines/pipeline/checked/vace_inputs.py
against diffusers' own functions: the mask channels (`WanVACEPipeline.prepare_masks`), the bilinear
resize (torch's `interpolate`) and the reference canvas (`preprocess_conditions`), at sizes and
frame counts the pipeline test does not reach.
"""

from __future__ import annotations

import numpy as np
import pytest

diffusers = pytest.importorskip("diffusers")
import torch  # noqa: E402

from pipelines.pipeline.checked.vace_inputs import bilinear, reference_canvas  # noqa: E402
from pipelines.wan.conditioning.vace import mask_channels  # noqa: E402
from tests.numerics import EPS_F32  # noqa: E402


class _Facts:  # what diffusers' prepare_masks / preprocess_conditions read of the pipeline
  vae_scale_factor_temporal = 4
  vae_scale_factor_spatial = 8

  class transformer:  # noqa: N801
    class config:  # noqa: N801
      patch_size = (1, 2, 2)


@pytest.mark.parametrize("frames,height,width", [(9, 32, 48), (17, 16, 64), (81, 48, 32), (1, 16, 16)])
def test_mask_channels_equal_diffusers(frames, height, width):
  rng = np.random.default_rng(frames)
  mask = rng.random((frames, height, width), dtype=np.float32)
  want = diffusers.WanVACEPipeline.prepare_masks(_Facts(), torch.from_numpy(mask)[None, None].expand(1, 3, -1, -1, -1),
                                                 [[]])
  np.testing.assert_array_equal(mask_channels(mask, 4, 8), want[0].numpy())


@pytest.mark.parametrize("size,out", [((20, 28), (34, 48)), ((40, 24), (32, 19)), ((16, 16), (16, 16)),
                                      ((7, 33), (50, 3))])
def test_bilinear_equals_torch(size, out):
  image = np.random.default_rng(1).standard_normal((3, *size)).astype(np.float32)
  want = torch.nn.functional.interpolate(torch.from_numpy(image)[None], size=out, mode="bilinear",
                                         align_corners=False)[0].numpy()
  # A convex combination of 4 values whose float32 weights are computed in another order: within
  # 8 eps of the largest |value| (measured <= 4 eps).
  np.testing.assert_allclose(bilinear(image, *out), want, rtol=0, atol=8 * EPS_F32 * np.abs(image).max())


@pytest.mark.parametrize("size", [(20, 28), (44, 24), (32, 48), (13, 70)])
def test_reference_canvas_equals_diffusers(size):
  import PIL.Image

  image = np.random.default_rng(2).integers(0, 256, (*size, 3), dtype=np.uint8)
  pipe = diffusers.WanVACEPipeline.__new__(diffusers.WanVACEPipeline)
  pipe.transformer = _Facts.transformer
  pipe.vae_scale_factor_spatial = 8
  pipe.video_processor = diffusers.video_processor.VideoProcessor(vae_scale_factor=8)
  _, _, refs = diffusers.WanVACEPipeline.preprocess_conditions(
      pipe, None, None, [PIL.Image.fromarray(image)], 1, 32, 48, 9, torch.float32, torch.device("cpu"))
  # values in [-1, 1]: the same bilinear bound, plus the [-1, 1] mapping's rounding
  np.testing.assert_allclose(reference_canvas(image, 32, 48, 8), refs[0][0].numpy(), rtol=0, atol=16 * EPS_F32)
