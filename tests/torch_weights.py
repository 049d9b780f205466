"""Random weights for the tiny torch reference models the parity tests build (diffusers' default
init leaves norms at 1, biases and modulation tables at 0, which would let bugs in those paths hide)."""

import numpy as np
import torch


def randomize(module: torch.nn.Module, seed: int, *, spread: float = 1.0) -> None:
  """Seeded weights: norm gains 1 + 0.2s N(0,1), modulation tables 0.3s N, 1-D params 0.1s N,
  matrices N / sqrt(fan_in); s = `spread`."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if "norm" in name and name.endswith("weight"):
        p.copy_(1.0 + 0.2 * spread * noise)
      elif "scale_shift_table" in name:
        p.copy_(0.3 * spread * noise)
      elif p.ndim == 1:
        p.copy_(0.1 * spread * noise)
      else:
        p.copy_(noise / np.sqrt(int(np.prod(p.shape[1:]))))
