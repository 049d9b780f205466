"""`wan.vae.original_names`: the original Wan VAE names (from the topology), checked against
diffusers' converter (`convert_wan_vae_to_diffusers`, hard-coded for the released Wan 2.1 VAE)."""

from pipelines.wan.vae import VAE_PRESETS, original_keys


def test_diffusers_converter_agrees_on_the_wan21_vae():
  from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

  names = original_keys(VAE_PRESETS["wan2.1"])
  converted = convert_wan_vae_to_diffusers({o: d for d, o in names.items()})
  assert len(names) == 194 and converted == {d: d for d in names}


def test_wan22_nesting():
  names = original_keys(VAE_PRESETS["wan2.2"])
  assert names["encoder.down_blocks.0.downsampler.resample.1.weight"] == "encoder.downsamples.0.downsamples.2.resample.1.weight"
  assert names["decoder.up_blocks.0.upsampler.resample.1.weight"] == "decoder.upsamples.0.upsamples.3.resample.1.weight"
  assert names["decoder.up_blocks.1.resnets.0.norm1.gamma"] == "decoder.upsamples.1.upsamples.0.residual.0.gamma"
  assert names["quant_conv.weight"] == "conv1.weight" and names["decoder.norm_out.gamma"] == "decoder.head.0.gamma"
