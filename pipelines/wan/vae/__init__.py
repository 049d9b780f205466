"""The Wan causal video VAE (diffusers' `AutoencoderKLWan`): config and presets, the architecture as
data, layers, chunked encode and decode (also split over a mesh, in bands of rows, or streamed
layer by layer in bounded memory), and the decoder's compile effort.

The names below are imported on first use (`lazy_facade`), so that importing the package
imports none of its modules, and a JAX-free module among them loads without JAX.
"""

from lazy_facade import lazy_facade

_HOMES = (
    ("pipelines.wan.vae.band_memory", ("choose_band_rows", "decode_memory", "decode_step_memory_analysis",
                                       "program_peak")),
    ("pipelines.wan.vae.bands", ("band_plan", "decode_banded", "decoder_split", "encode_banded",
                                 "encoder_radius", "encoder_split", "lower_decode_band_programs",
                                 "tail_radius")),
    ("pipelines.wan.vae.config", ("VAE_PRESETS", "WAN21_LATENTS_MEAN", "WAN21_LATENTS_STD",
                                  "WAN22_LATENTS_MEAN", "WAN22_LATENTS_STD", "WanVAEConfig")),
    ("pipelines.wan.vae.effort", ("TPU_DECODE_COMPILE_EFFORT", "check_compile_effort",
                                  "decode_compile_effort", "effective_compile_effort")),
    ("pipelines.wan.vae.encoding", ("check_video", "encode", "encode_chunk", "latent_distribution")),
    ("pipelines.wan.vae.model", ("ENCODER_CHUNK", "WanVAE", "abstract_vae", "check_latents", "decode", "decode_chunk",
                                 "decode_continued", "decode_parallel", "decode_parallel_chunks",
                                 "denormalize_latents", "init_vae", "latent_stats", "load_vae",
                                 "lower_decode_programs", "normalize_latents", "platform_of", "row_mesh", "row_split",
                                 "vae_from_state")),
    ("pipelines.wan.vae.streamed", ("decode_plan", "decode_streamed", "streamed_decode_memory", "streamed_memory")),
    ("pipelines.wan.vae.original_names", ("encoder_key", "original_keys")),
    ("pipelines.wan.vae.topology", ("decode_flops", "to_jax_layout")),
)

__all__, __getattr__ = lazy_facade(__name__, _HOMES)
