"""What one denoising step feeds the transformer besides the text: `StepInputs`, made by every
conditioning (`transformer_inputs` of image-to-video's, TI2V's and VACE's) the same way, so the step
has no model-kind branch.

Glossary (DESIGN.md section 1): B rows (2B under classifier-free guidance), C' the transformer's
input channels, F / Hl / Wl latent frames / height / width, T tokens, J image tokens, I CLIP width,
Cv VACE context channels, V VACE blocks.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class StepInputs(NamedTuple):
  """The transformer's inputs of one step (`transformer.forward`'s arguments of the same names).

  Attributes:
    latents: [B, C', F, Hl, Wl] in the model dtype (image-to-video: noise, mask and condition
      channels).
    timestep: [B], or per token [B, T] (TI2V: a `transformer.timesteps.TokenTimesteps`).
    image: CLIP states [B, J, I] for a transformer with an image branch, else None.
    control: the VACE context [B, Cv, F, Hl, Wl] for a VACE transformer, else None.
    control_scale: float32 [V] the VACE blocks' scales, else None.
  """
  latents: Any
  timestep: Any
  image: Any = None
  control: Any = None
  control_scale: Any = None
