"""The memory plan's choice (`parallel.memory.MemoryPlan.choose`) on made-up component bytes."""

import dataclasses

import pytest

from pipelines.parallel.memory import GiB, ComponentBytes, MemoryPlan, host_available, host_copies

# Wan 2.1 1.3B at 480p x 81 on one 16 GB chip, roughly: UMT5-XXL 12.5 GiB, transformer 2.6 GiB.
BYTES = ComponentBytes(text_encoder=int(12.5 * GiB), experts=(int(2.6 * GiB),), vae=int(0.5 * GiB),
                       text_work=int(0.3 * GiB), step_work=int(3 * GiB), decode_work=int(9 * GiB))


def test_all_resident_where_everything_fits():
  plan = MemoryPlan.choose(BYTES, 100 * GiB)
  assert (plan.placement, plan.transformer_at_encode, plan.transformer_at_decode) == ("resident", True, True)
  assert not plan.moves_weights and plan.peak == int(12.5 * GiB) + int(2.6 * GiB) + int(0.5 * GiB) + int(9 * GiB)


def test_no_budget_is_resident():
  assert MemoryPlan.choose(BYTES, None) == MemoryPlan()
  assert MemoryPlan.choose(BYTES, None, placement="encoder-on-host").placement == "encoder-on-host"


def test_one_chip_offloads_the_encoder_and_moves_the_transformer_for_the_encode():
  plan = MemoryPlan.choose(BYTES, int(14.5 * GiB))
  assert plan.placement == "encoder-offloaded"
  assert not plan.transformer_at_encode  # 12.5 + 2.6 + 0.5 + 0.3 > 14.5
  assert plan.transformer_at_decode  # 2.6 + 0.5 + 9 fits
  assert plan.peak == int(12.5 * GiB) + int(0.5 * GiB) + int(0.3 * GiB)


def test_transformer_stays_for_the_decode_when_both_fit():
  plan = MemoryPlan.choose(BYTES, int(16 * GiB))
  assert plan.placement == "encoder-offloaded" and plan.transformer_at_encode and plan.transformer_at_decode


def test_encoder_on_host_when_it_does_not_fit_alone():
  plan = MemoryPlan.choose(BYTES, int(12 * GiB))
  assert plan.placement == "encoder-on-host" and plan.decode_band_rows is None
  assert plan.peak == int(0.5 * GiB) + int(9 * GiB)  # the decode, the transformer gone


def test_bands_where_even_the_decoder_alone_does_not_fit():
  asked = []

  def band_rows_for(available):
    asked.append(available)
    return 7

  plan = MemoryPlan.choose(BYTES, int(8 * GiB), band_rows_for=band_rows_for)
  assert plan.placement == "encoder-on-host" and plan.decode_band_rows == 7 and not plan.transformer_at_decode
  assert asked[-1] == int(8 * GiB) - int(0.5 * GiB) and plan.peak <= int(8 * GiB)
  assert "bands of 7 latent rows" in plan.line()


def test_two_experts_swap_when_both_do_not_fit():
  two = ComponentBytes(text_encoder=GiB, experts=(6 * GiB, 6 * GiB), vae=GiB, text_work=0, step_work=2 * GiB,
                       decode_work=2 * GiB)
  plan = MemoryPlan.choose(two, 12 * GiB)
  assert plan.experts_swapped and plan.peak <= 12 * GiB
  assert not MemoryPlan.choose(two, 20 * GiB).experts_swapped


def test_forced_placement_is_kept_even_where_it_does_not_fit():
  plan = MemoryPlan.choose(BYTES, int(12 * GiB), placement="resident")
  assert plan.placement == "resident" and plan.forced and plan.peak > int(12 * GiB)
  assert "(asked for)" in plan.line()


def test_nothing_fits_names_the_stage_and_the_fix():
  with pytest.raises(ValueError, match=r"9.5 GiB needed by its largest stage \(decode\), 4.0 GiB.*--quantize int8"):
    MemoryPlan.choose(BYTES, 4 * GiB)


def test_unknown_placement_is_refused():
  with pytest.raises(ValueError, match="placement='cpu-offload'.*encoder-on-host"):
    MemoryPlan.choose(BYTES, GiB, placement="cpu-offload")


def test_streamed_decode_before_bands():
  """A whole decode too large for the device alone, the layer-streamed one small enough: streamed,
  no bands; where neither fits, bands."""
  streamed = dataclasses.replace(BYTES, streamed_work=int(6 * GiB))
  plan = MemoryPlan.choose(streamed, int(8 * GiB), band_rows_for=lambda available: 5)
  assert plan.decode_streamed and plan.decode_band_rows is None and "streamed layer by layer" in plan.line()
  plan = MemoryPlan.choose(streamed, int(6.3 * GiB), band_rows_for=lambda available: 5)  # 0.5 + 6 > 6.3
  assert not plan.decode_streamed and plan.decode_band_rows == 5


def test_the_vae_leaves_for_the_loop_when_the_step_does_not_fit_beside_it():
  """Wan 2.2 TI2V-5B at 704x1280x121, roughly: 9.3 GiB of weights, a 2.7 GiB VAE (XLA's step at
  that size: 3.4 GB); with 3 GiB of step the VAE leaves for the loop (back for the decode), with 1 GiB
  it stays. Where only the modelled step (7.4 GiB: the planner's upper bound) fits in no plan, the
  most frugal plan runs and says so; weights that do not fit are refused."""
  ti2v = ComponentBytes(text_encoder=int(12.5 * GiB), experts=(int(9.3 * GiB),), vae=int(2.7 * GiB),
                        text_work=int(0.3 * GiB), step_work=3 * GiB, decode_work=int(5 * GiB))
  plan = MemoryPlan.choose(ti2v, int(14.5 * GiB))
  assert not plan.vae_at_denoise and plan.moves_weights and plan.peak <= int(14.5 * GiB)
  # the encode: 12.5 + 2.7 + 0.3 > 14.5, so the VAE leaves for it too and the encoder is uploaded
  assert plan.placement == "encoder-offloaded" and not plan.vae_at_encode
  assert "VAE off the device for the encode, VAE off the device for the denoise" in plan.line()
  assert MemoryPlan.choose(dataclasses.replace(ti2v, step_work=GiB), int(14.5 * GiB)).vae_at_denoise
  big = dataclasses.replace(ti2v, step_work=int(7.4 * GiB))  # the planner's upper bound for that step
  frugal = MemoryPlan.choose(big, int(14.5 * GiB))  # only the modelled step is over: the most frugal plan
  assert (frugal.placement, frugal.vae_at_denoise, frugal.forced) == ("encoder-on-host", False, False)
  assert frugal.peak > int(14.5 * GiB) and "over by the step's modelled share" in frugal.line()
  assert "over" not in plan.line()
  heavy = dataclasses.replace(ti2v, experts=(int(15 * GiB),))  # the weights alone do not fit: refused
  with pytest.raises(ValueError, match=r"\(denoise\).*--quantize int8"):
    MemoryPlan.choose(heavy, int(14.5 * GiB))


def test_the_host_copies_of_what_moves_are_counted():
  """`MemoryPlan.host`: a copy of each component that leaves the device (TI2V-5B's plan: the encoder,
  the transformer and the VAE, 24.5 GiB), the encode's activations too when the encoder runs on the
  host; nothing for a resident plan, whose line does not mention the host."""
  ti2v = ComponentBytes(text_encoder=int(12.5 * GiB), experts=(int(9.3 * GiB),), vae=int(2.7 * GiB),
                        text_work=int(0.3 * GiB), step_work=3 * GiB, decode_work=int(5 * GiB))
  plan = MemoryPlan.choose(ti2v, int(14.5 * GiB))
  assert plan.host == ti2v.text_encoder + ti2v.transformer + ti2v.vae
  assert "host copies 24.5 GiB" in plan.line()
  on_host = MemoryPlan.choose(ti2v, int(14.5 * GiB), placement="encoder-on-host")
  assert on_host.host == host_copies(ti2v, on_host) and on_host.host >= ti2v.text_encoder + ti2v.text_work
  resident = MemoryPlan.choose(ti2v, 64 * GiB)
  assert resident.placement == "resident" and resident.host == 0 and "host" not in resident.line()


def test_host_available_reads_the_kernel():
  available = host_available()
  assert available is None or 0 < available < 2 ** 50
