"""Text states for the denoiser: prompts cleaned, tokenised and UMT5-encoded, or given as embeds.

Glossary (DESIGN.md section 1): B prompts, B' = B x num_videos_per_prompt, L text tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pipelines.parallel import distributed
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.wan.encoders import UMT5Config, UMT5Params, encode_text, encode_text_layerwise, prompt_clean, tokenize

_encode_jit = jax.jit(encode_text, static_argnames="config")


@jax.jit
def _masked_text(embeds: jax.Array, mask: jax.Array) -> jax.Array:
  """[B, L, D] embeddings with rows past each prompt's true length zeroed (mask int [B, L])."""
  return jnp.where(mask[..., None] > 0, embeds, jnp.zeros((), embeds.dtype))


def encode_prompts(tokenizer: Any, config: UMT5Config, params: UMT5Params, prompts: Sequence[str],
                   max_sequence_length: int, dtype: Any, mesh: Mesh | None = None) -> jax.Array:
  """Cleaned (`tokenizer.prompt_clean`), tokenised and UMT5-encoded prompts, zero past each true
  length (diffusers' `_get_t5_prompt_embeds`: trim to the true length, pad with zeros).

  Args:
    tokenizer, config, params: the text encoder's tokenizer, config and weights.
    prompts: B strings.
    max_sequence_length: L (prompts truncated / padded to it).
    dtype: the output dtype (diffusers casts to the transformer dtype).
    mesh: the mesh the encoder's weights are sharded over, or None (weights on one device).

  Returns:
    [B, L, d_model] in `dtype`.
  """
  ids, mask = tokenize(tokenizer, [prompt_clean(p) for p in prompts],
                                    max_sequence_length)
  if mesh is not None:
    ids, mask = distributed.put_replicated((np.asarray(ids), np.asarray(mask)), NamedSharding(mesh, P()))
  else:  # where the weights are: the default device, or the host CPU (a memory plan's encoder-on-host)
    leaf = jax.tree.leaves(params)[0]
    device = next(iter(leaf.devices())) if isinstance(leaf, jax.Array) else None
    ids, mask = jax.device_put((np.asarray(ids), np.asarray(mask)), device)
  on_cpu = mesh is None and (device or jax.devices()[0]).platform == "cpu"
  # on the CPU one layer at a time: XLA:CPU would hold every layer's fp32 conversion of bf16 weights at once
  embeds = (encode_text_layerwise(params, ids, mask, config=config) if on_cpu
            else _encode_jit(params, ids, mask, config=config))
  return _masked_text(embeds, mask).astype(dtype)


def text_states(request: GenerationRequest, encode: Callable[[list[str], int], jax.Array], dtype: Any) -> jax.Array:
  """The denoiser's text input: [B', L, text_dim], or under CFG [2 B', L, text_dim] (cond rows,
  then uncond rows), in `dtype`.

  Given embeds are used as they are (cast to `dtype`, as diffusers' `.to(transformer_dtype)`); the
  rest are encoded with `encode(prompts, L)`; then each prompt's row is repeated
  num_videos_per_prompt times in place (diffusers' `repeat(1, n, 1).view(B * n, L, -1)`).
  """
  r = request
  texts = (r.prompts or []) + (r.negative_prompts or [])
  encoded = encode(texts, r.max_sequence_length) if texts else None
  n = r.num_videos_per_prompt
  if n == 1 and r.prompt_embeds is None and r.negative_prompt_embeds is None and encoded is not None:
    return encoded  # already cond rows then uncond rows: no slice and concatenate programs to look up
  parts, used = [], 0
  for given, names in ((r.prompt_embeds, r.prompts), (r.negative_prompt_embeds, r.negative_prompts)):
    if given is not None:
      parts.append(jnp.asarray(given).astype(dtype))
    elif names is not None:
      parts.append(encoded[used:used + len(names)])
      used += len(names)
  return jnp.concatenate([part if n == 1 else jnp.repeat(part, n, axis=0) for part in parts])
