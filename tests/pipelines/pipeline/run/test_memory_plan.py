"""A call under each memory plan gives the same video: weights that leave the device between the
stages (the text encoder, the transformer, one expert of two, the VAE) come back unchanged, the encoder
on the host CPU encodes the same text, and a decode in bands equals the whole-frame decode to fp32
rounding."""

import numpy as np
import pytest

from pipelines import WanPipeline
from pipelines.parallel.memory import MemoryPlan
from pipelines.pipeline.run import memory_plan, runner
from tests.numerics import FP32_VIDEO_PSNR_DB, assert_psnr_at_least

CALL = dict(prompt="a red fox", negative_prompt="blurry", height=64, width=64, num_frames=9,
            num_inference_steps=2, seed=3, max_sequence_length=16, progress=False)
PLANS = {
    "encoder-offloaded": MemoryPlan(placement="encoder-offloaded", transformer_at_encode=False,
                                    transformer_at_decode=False),
    "encoder-on-host": MemoryPlan(placement="encoder-on-host", transformer_at_decode=False),
    "banded": MemoryPlan(placement="encoder-offloaded", decode_band_rows=3),
    "streamed": MemoryPlan(placement="encoder-offloaded", transformer_at_decode=False, decode_streamed=True),
    "VAE away": MemoryPlan(placement="encoder-offloaded", vae_at_encode=False, vae_at_denoise=False,
                           transformer_at_decode=False),
}


@pytest.fixture(scope="module")
def pipe():
  return WanPipeline.tiny(random=True)


@pytest.fixture(scope="module")
def resident(pipe):
  return pipe.run(**CALL)


def _with_plan(monkeypatch, plan: MemoryPlan) -> None:
  monkeypatch.setattr(runner, "plan_memory", lambda pipe, request, placement, decoder=None: plan)


@pytest.mark.parametrize("name", list(PLANS))
def test_each_plan_gives_the_resident_video(pipe, resident, monkeypatch, name):
  _with_plan(monkeypatch, PLANS[name])
  first = pipe.run(**CALL)
  if name != "encoder-on-host":
    assert all(isinstance(x, np.ndarray) for x in _leaves(pipe.weights.text_params)), "the encoder was not dropped"
  second = pipe.run(**CALL)  # the dropped weights come back for the next call
  assert first.settings["memory_plan"] == PLANS[name].line()
  for result in (first, second):
    np.testing.assert_array_equal(result.latents, resident.latents)
    if PLANS[name].decode_band_rows is None and not PLANS[name].decode_streamed:
      np.testing.assert_array_equal(result.frames, resident.frames)
    else:
      assert_psnr_at_least(result.frames, resident.frames, FP32_VIDEO_PSNR_DB, name=f"{name} decode")
  other = pipe.run(**dict(CALL, seed=4))  # positive control: the comparison sees the video
  assert np.abs(other.frames - resident.frames).max() > 0.05


def test_forced_placement_is_said(pipe, resident):
  pipe.set_memory_placement("encoder-on-host")
  try:
    result = pipe.run(**CALL)
  finally:
    pipe.set_memory_placement("auto")
  assert result.settings["memory_plan"] == "memory plan: encoder-on-host (asked for)"
  np.testing.assert_array_equal(result.frames, resident.frames)
  with pytest.raises(ValueError, match="placement='offload'.*encoder-offloaded"):
    pipe.set_memory_placement("offload")


def test_auto_on_a_small_device_moves_the_encoder(pipe, resident, monkeypatch):
  """A device budget below the weights' sum: the auto plan moves the text encoder, same video."""
  weights = pipe.weights.bytes_of()
  text, transformer = weights["text_encoder"], weights["experts"][0]
  budget = max(text, transformer) + weights["vae"] + min(text, transformer) // 2  # each fits alone, not both
  monkeypatch.setattr(memory_plan, "device_budget", lambda device=None: budget)
  monkeypatch.setattr(memory_plan, "decode_work_bytes", lambda weights, shape, mesh, decoder=None: 0)
  monkeypatch.setattr(memory_plan, "step_work_bytes", lambda request, temp_bytes=None: 0)
  monkeypatch.setattr(memory_plan, "text_work_bytes", lambda config, prompts, length: 0)
  result = pipe.run(**CALL)
  assert result.settings["memory_plan"].startswith("memory plan: encoder-offloaded, transformer off the device for "
                                                   "the encode"), result.settings["memory_plan"]
  np.testing.assert_array_equal(result.frames, resident.frames)


def _leaves(tree):
  import jax
  return jax.tree.leaves(tree)


def test_a_text_encoder_too_large_for_the_device_is_loaded_to_the_host(monkeypatch):
  """`loading.text_encoder_shardings`: the default device while the encoder fits beside what is
  placed, the host CPU beyond; a CPU backend (no memory limit) always the default device."""
  import jax
  import jax.numpy as jnp

  from pipelines.parallel import memory
  from pipelines.pipeline.load import loading
  from pipelines.wan.encoders import umt5

  config = umt5.UMT5_PRESETS["tiny"]
  assert loading.text_encoder_shardings(config, jnp.float32) is None  # CPU: no limit
  need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(umt5.abstract_umt5_params(config)))
  monkeypatch.setattr(memory, "device_budget", lambda device=None: need)
  assert loading.text_encoder_shardings(config, jnp.float32) is None  # fits exactly (nothing else in use)
  monkeypatch.setattr(memory, "device_budget", lambda device=None: need - 1)
  shardings = loading.text_encoder_shardings(config, jnp.float32)
  placed = jax.tree.leaves(shardings(umt5.abstract_umt5_params(config)))
  assert placed and all(s.device_set == {jax.devices("cpu")[0]} for s in placed)


def test_prompts_seen_before_need_no_encoder(pipe, resident, monkeypatch):
  """With the encoder off the device, a call encodes only prompts not seen before (the negative
  prompt once for all calls); a prompt seen before costs no encode at all; the video is the one
  the resident encoder gives (a row encoded in another batch: within fp32 rounding)."""
  _with_plan(monkeypatch, PLANS["encoder-offloaded"])
  pipe.text_cache.clear()
  encoded = []
  real = pipe.encode_prompts
  monkeypatch.setattr(pipe, "encode_prompts", lambda prompts, length: encoded.append(list(prompts)) or real(prompts, length))
  first = pipe.run(**CALL)
  other = pipe.run(**dict(CALL, prompt="a blue fox"))
  again = pipe.run(**CALL)
  assert encoded == [["a red fox", "blurry"], ["a blue fox"]]
  np.testing.assert_array_equal(first.frames, resident.frames)
  np.testing.assert_array_equal(again.frames, resident.frames)
  monkeypatch.undo()
  alone = pipe.run(**dict(CALL, prompt="a blue fox"))
  assert_psnr_at_least(other.frames, alone.frames, FP32_VIDEO_PSNR_DB, name="a cached negative prompt")
  assert np.abs(other.frames - first.frames).max() > 0.05  # the new prompt did change the video


def test_two_experts_one_at_a_time_give_the_resident_video(monkeypatch):
  """Wan 2.2 A14B's rule: one expert on the device at a time (the other dropped at the switch)."""
  import jax

  from pipelines.pipeline.load import loading
  from pipelines.wan.pretrained import tiny
  from pipelines.wan.transformer import init_transformer

  parts = loading.tiny_random_parts("float32")
  parts.update(transformers=[parts["transformers"][0], init_transformer(tiny.TINY_TRANSFORMER, tiny.TINY_SEED + 1)],
               boundary_ratio=0.95)
  two = WanPipeline(**parts)
  call = dict(CALL, num_inference_steps=4)
  resident = two.run(**call)
  assert set(resident.settings["experts_per_step"]) == {0, 1}  # both experts run (the swap is exercised)
  _with_plan(monkeypatch, MemoryPlan(placement="encoder-offloaded", experts_swapped=True, transformer_at_decode=False))
  swapped = two.run(**call)
  np.testing.assert_array_equal(swapped.frames, resident.frames)
  assert all(isinstance(x, np.ndarray) for state in two.weights.experts for x in jax.tree.leaves(state))
  again = two.run(**call)  # both come back in turn
  np.testing.assert_array_equal(again.frames, resident.frames)


def test_the_vae_is_off_the_device_during_the_loop(pipe, resident, monkeypatch):
  """`vae_at_denoise=False`: at every step the VAE's weights are host copies (numpy), and it is back
  on the device for the decode (the video equal); positive control: the resident plan keeps it."""
  seen = []

  def on_step_end(p, step, timestep, tensors):
    seen.append(all(isinstance(x, np.ndarray) for x in _leaves(p.weights.vae)))
    return tensors

  for plan, away in ((MemoryPlan(vae_at_denoise=False), True), (MemoryPlan(), False)):
    seen.clear()
    _with_plan(monkeypatch, plan)
    result = pipe.run(**CALL, callback_on_step_end=on_step_end)
    assert seen == [away] * CALL["num_inference_steps"]
    assert not any(isinstance(x, np.ndarray) for x in _leaves(pipe.weights.vae))
    np.testing.assert_array_equal(result.frames, resident.frames)



def test_the_vae_is_off_the_device_during_the_text_encode(pipe, monkeypatch):
  """`vae_at_encode=False`: the encoder runs while the VAE's weights are host copies; positive
  control: the encoder-offloaded plan without it keeps the VAE there. New prompts each time (the
  text cache would skip the encode)."""
  seen = []
  encode = pipe.encode_prompts

  def watched(*args, **kwargs):
    seen.append(all(isinstance(x, np.ndarray) for x in _leaves(pipe.weights.vae)))
    return encode(*args, **kwargs)

  monkeypatch.setattr(pipe, "encode_prompts", watched)
  for i, (plan, away) in enumerate(((MemoryPlan(placement="encoder-offloaded", vae_at_encode=False), True),
                                    (MemoryPlan(placement="encoder-offloaded"), False))):
    seen.clear()
    _with_plan(monkeypatch, plan)
    pipe.run(**dict(CALL, prompt=f"a fox number {i} in the text encode test"))
    assert seen and all(s == away for s in seen), seen
    assert not any(isinstance(x, np.ndarray) for x in _leaves(pipe.weights.vae))  # back after the call


def test_the_host_encode_keeps_one_host_copy_of_the_encoder():
  """encoder-on-host: the CPU backend's arrays become the host copy (numpy views share their memory),
  not a second copy beside the numpy one (UMT5-XXL: 11.4 GB more); the values are the given ones and
  a second encode moves nothing."""
  import jax

  from pipelines.pipeline.load.placement import PlacedWeights
  from pipelines.wan.encoders import umt5

  given = jax.device_get(umt5.init_umt5_params(umt5.UMT5_PRESETS["tiny"], 0))
  expected = jax.tree.map(np.array, given)  # copies, to compare with after the move
  weights = PlacedWeights([], given, vae=None)
  del given
  on_host = weights.text_params_on("host")
  host_copy = weights._host_text()
  for leaf, copy, want in zip(_leaves(on_host), _leaves(host_copy), _leaves(expected)):
    assert isinstance(leaf, jax.Array) and leaf.devices() == {jax.devices("cpu")[0]}
    assert copy is leaf  # one host copy
    np.testing.assert_array_equal(np.asarray(leaf), want)
  weights.drop_text()
  assert all(a is b for a, b in zip(_leaves(weights.text_params), _leaves(on_host)))
  assert weights.text_params_on("host") is weights.text_params  # nothing moves the second time


def test_a_plan_whose_host_copies_do_not_fit_the_host_warns():
  """The host copies a plan takes beyond those held already, against the host's available memory:
  a warning naming both (the alternative is the kernel killing the process midway, silently); none
  when they fit (the positive control) or when nothing moves."""
  import warnings

  plan = MemoryPlan(placement="encoder-offloaded", host=30 * 2 ** 30)
  with pytest.warns(UserWarning, match=r"need 20\.0 GiB more host memory, 8\.0 GiB are available"):
    memory_plan._warn_if_host_short(plan, held=10 * 2 ** 30, available=8 * 2 ** 30)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    memory_plan._warn_if_host_short(plan, held=10 * 2 ** 30, available=21 * 2 ** 30)
    memory_plan._warn_if_host_short(MemoryPlan(host=0), held=0, available=0)


def test_host_bytes_counts_each_host_array_once():
  """`PlacedWeights.host_bytes`: numpy and CPU-backend leaves, each once (the host copy and the
  weights may be the same arrays)."""
  import jax

  from pipelines.pipeline.load.placement import PlacedWeights
  from pipelines.wan.encoders import umt5

  given = jax.device_get(umt5.init_umt5_params(umt5.UMT5_PRESETS["tiny"], 0))
  size = sum(x.nbytes for x in _leaves(given))
  weights = PlacedWeights([], given, vae=None)
  assert weights.host_bytes() == size
  weights.text_params_on("host")  # the CPU backend's arrays become the host copy: still one copy
  assert weights.host_bytes() == size


def test_a_second_call_plans_the_step_from_its_compiled_program(monkeypatch):
  """The first call's step is the planner's model (an upper bound); once a call of these shapes has
  compiled its step, the next call's plan counts XLA's temporaries of that program instead (its
  line says so) and they are what `memory_analysis()` of the compiled step reports. Positive
  control: another video size has no compiled step and stays modelled."""
  from pipelines.parallel import memory

  pipe = WanPipeline.tiny(random=True)
  monkeypatch.setattr(memory_plan, "device_budget", lambda device=None: 64 * 2 ** 30)
  request = pipe.check_inputs(**{k: v for k, v in CALL.items() if k != "progress"})
  first = memory_plan.plan_memory(pipe, request)
  assert not first.step_measured and "compiled program" not in first.line()
  pipe.run(**CALL)
  measured = pipe.compiled_steps.temp_bytes(request.plan, request.latent_shape)
  (program,) = pipe.compiled_steps.programs()
  assert measured == program.memory_analysis().temp_size_in_bytes > 0
  second = memory_plan.plan_memory(pipe, request)
  assert second.step_measured and "the step's from its compiled program" in second.line()
  assert memory_plan.step_work_bytes(request, measured) == memory_plan.step_work_bytes(request, 0) + measured
  other = pipe.check_inputs(**{k: v for k, v in CALL.items() if k != "progress"} | {"height": 96})
  assert not memory_plan.plan_memory(pipe, other).step_measured
  assert memory.MemoryPlan().step_measured is False
