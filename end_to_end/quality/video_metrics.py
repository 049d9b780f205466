"""Frame-wise PSNR and SSIM of two videos in [0, 1], and their summary (mean, min over frames).

Videos are float [B, frames, height, width, 3] (the pipeline's output) or [frames, height, width, 3];
the B videos are laid end to end, so "frame i" counts over all of them. SSIM is scikit-image's
`structural_similarity` (Wang et al. 2004) with `data_range=1.0` (the frames' value range, NOT the
observed min/max: estimating it per frame would make noise-like frames look better than they are)
and `channel_axis=-1` (SSIM per RGB channel, averaged), 7x7 uniform window (its default).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# PSNR of identical frames is +inf; it is reported as this cap so that the JSON stays standard
# (json.dump would write the non-standard token `Infinity`). 10 log10(1 / 1e-20) = 200 dB.
PSNR_CAP_DB = 200.0
_MSE_FLOOR = 10 ** (-PSNR_CAP_DB / 10)


def _frames(video: Any, name: str) -> np.ndarray:
  """[B, F, H, W, 3] or [F, H, W, 3] -> float64 [B*F, H, W, 3]; raises ValueError otherwise."""
  x = np.asarray(video, np.float64)
  if x.ndim == 5:
    x = x.reshape(-1, *x.shape[2:])
  if x.ndim != 4 or x.shape[-1] != 3:
    raise ValueError(f"{name} must be [B, frames, H, W, 3] or [frames, H, W, 3], got {x.shape=}")
  return x


def _check_pair(reference: Any, candidate: Any) -> tuple[np.ndarray, np.ndarray]:
  ref, cand = _frames(reference, "reference"), _frames(candidate, "candidate")
  if ref.shape != cand.shape:
    raise ValueError(f"videos differ in shape: reference {ref.shape} vs candidate {cand.shape}; run "
                     "both with the same size, frames and prompts")
  if min(ref.shape[1:3]) < 7:
    raise ValueError(f"frames of {ref.shape[1]}x{ref.shape[2]} px are smaller than SSIM's 7x7 window")
  return ref, cand


def psnr_per_frame(reference: Any, candidate: Any) -> np.ndarray:
  """PSNR in dB per frame, data range 1: 10 log10(1 / MSE). Identical frames give `PSNR_CAP_DB`.

  Args:
    reference, candidate: float videos in [0, 1], [B, frames, H, W, 3] or [frames, H, W, 3].

  Returns:
    float64 [B * frames].

  Raises:
    ValueError: shapes that differ or are not videos.
  """
  ref, cand = _check_pair(reference, candidate)
  mse = np.mean((ref - cand) ** 2, axis=(1, 2, 3))
  return 10.0 * np.log10(1.0 / np.maximum(mse, _MSE_FLOOR))


def ssim_per_frame(reference: Any, candidate: Any) -> np.ndarray:
  """SSIM per frame (scikit-image, data_range=1.0, channel_axis=-1), in [-1, 1].

  Returns:
    float64 [B * frames].

  Raises:
    ValueError: shapes that differ, are not videos, or frames under 7x7 pixels.
  """
  from skimage.metrics import structural_similarity

  ref, cand = _check_pair(reference, candidate)
  return np.array([structural_similarity(r, c, data_range=1.0, channel_axis=-1) for r, c in zip(ref, cand)])


def compare_videos(reference: Any, candidate: Any) -> dict[str, Any]:
  """Per-frame and summary PSNR (dB) and SSIM of `candidate` against `reference`.

  Returns:
    dict with psnr_per_frame, ssim_per_frame (lists), psnr_mean, psnr_min, ssim_mean, ssim_min,
    max_abs_pixel_diff (all floats; pixels in [0, 1]). psnr_mean is the mean of the per-frame values.
  """
  psnr = psnr_per_frame(reference, candidate)
  ssim = ssim_per_frame(reference, candidate)
  diff = float(np.max(np.abs(_frames(reference, "reference") - _frames(candidate, "candidate"))))
  out = dict(psnr_per_frame=[float(v) for v in psnr], ssim_per_frame=[float(v) for v in ssim],
             psnr_mean=float(np.mean(psnr)), psnr_min=float(np.min(psnr)),
             ssim_mean=float(np.mean(ssim)), ssim_min=float(np.min(ssim)), max_abs_pixel_diff=diff)
  return out


def max_abs_diff(a: Any, b: Any) -> float:
  """max |a - b| in float64 over arrays of one shape (e.g. final latents [B, C, F, Hl, Wl])."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape:
    raise ValueError(f"shapes differ: {a.shape=} vs {b.shape=}")
  return float(np.max(np.abs(a - b)))
