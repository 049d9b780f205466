"""end_to_end.train.long_clips's pieces against the product code they must agree with: the decoder's
scan is the pipeline's chunked decode, the TI2V training rows are what `expand_timesteps` sampling
feeds the transformer, and the training set's windows are slices of the long clips' latents."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from end_to_end.train import long_clips, run_report, synthetic_world as world, tiny as train_tiny
from pipelines.wan import vae as wan_vae
from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER, TINY_I2V_FOLDER


def test_decoder_scan_is_the_pipelines_decode():
  """`decode_all` (one traced chunk in a scan, what the decoder trains through) equals `vae.decode`
  on 3 latent frames (9 video frames) of the random tiny VAE. Tolerance: fp32, |x| <= 1 -> 1e-5."""
  vae = wan_vae.init_vae(wan_vae.VAE_PRESETS["tiny"], jax.random.key(2))
  z = jnp.asarray(np.random.default_rng(2).standard_normal((1, 3, 2, 2, 16)).astype(np.float32))
  with jax.disable_jit():
    ours = long_clips.decode_all(vae.params, vae.config, z)
    theirs = wan_vae.decode(vae, jnp.moveaxis(z, -1, 1), video_layout="BFHWC")
  assert ours.shape == (1, 9, 16, 16, 3)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-5)


def _random_vae_encoder():
  vae = wan_vae.init_vae(wan_vae.VAE_PRESETS["tiny"], jax.random.key(3))
  return jax.jit(lambda x: long_clips.encode_mean(vae, x))


def test_stationary_latents_are_each_4th_frame_encoded_alone():
  """Latent frame k of a 25-frame clip is the source encoder's latent of video frame 4k as a
  one-frame clip; latent frame 0 is the plain (causal) encoding's latent frame 0, which sees frame 0
  only. Control: the plain encoding's latent frame 6 is not frame 24's picture. Tolerance: fp32
  encoder, |z| ~ 1 -> 1e-5."""
  encode = _random_vae_encoder()
  x = np.random.default_rng(4).uniform(-1, 1, (1, 25, 16, 16, 3)).astype(np.float32)
  z = long_clips.stationary_latents(encode, x)
  plain = np.asarray(encode(x))
  assert z.shape == plain.shape == (1, 7, 2, 2, 16)
  np.testing.assert_allclose(z[:, 0], plain[:, 0], atol=1e-5)
  np.testing.assert_allclose(z[:, 6], np.asarray(encode(x[:, 24:25]))[:, 0], atol=1e-5)
  np.testing.assert_allclose(z[:, 3], np.asarray(encode(x[:, 12:13]))[:, 0], atol=1e-5)
  assert np.abs(plain[:, 6] - z[:, 6]).max() > 1e-2


def test_stationary_latents_of_a_still_clip_are_one_latent():
  """A still clip (one frame repeated): every latent frame is the same, where the plain causal
  encoding's change along the clip (the control: what a long clip's windows would disagree on)."""
  encode = _random_vae_encoder()
  frame = np.random.default_rng(5).uniform(-1, 1, (1, 1, 16, 16, 3)).astype(np.float32)
  x = np.repeat(frame, 21, axis=1)
  z = long_clips.stationary_latents(encode, x)
  np.testing.assert_allclose(z, np.broadcast_to(z[:, :1], z.shape), atol=1e-5)
  plain = np.asarray(encode(x))
  assert np.abs(plain[:, 1:] - plain[:, 4:5]).max() > 1e-3


def test_vae_training_moves_what_it_trains():
  """`train_vae` moves encoder and decoder (the encoder towards `stationary_latents`, the decoder
  reconstructing from them); with `encoder` False the encoder's weights stay bit for bit (a VAE made
  stationary before keeps the latents its transformer learned) and the decoder still moves."""
  vae = wan_vae.init_vae(wan_vae.VAE_PRESETS["tiny"], jax.random.key(6))
  phases = ((5, 16, 1.0),)

  def moved(trained, prefixes):
    return [k for k in vae.params if k.startswith(prefixes) and not np.array_equal(vae.params[k], trained.params[k])]
  both, history = long_clips.train_vae(vae, 1e-3, seed=0, batch=1, phases=phases)
  assert len(history) == 1 and history[0][1] > 0 and history[0][2] > 0
  assert moved(both, long_clips.ENCODED) and moved(both, long_clips.DECODED)
  decoder_only, history = long_clips.train_vae(vae, 1e-3, seed=0, batch=1, phases=phases, encoder=False)
  assert history[0][1] == 0.0
  assert not moved(decoder_only, long_clips.ENCODED) and moved(decoder_only, long_clips.DECODED)


def test_a_target_encoders_pictures_are_what_the_vae_and_the_dataset_learn(monkeypatch):
  """`--target-encoder`: the decoder learns from `stationary_latents` of the target's encoder (not
  the trained VAE's: control), and the transformer's dataset rows are the same exact latents, in
  the pipeline's [n, z, F, Hl, Wl] layout. Tolerance: fp32 encoders, |z| ~ 1 -> 1e-5."""
  vae = wan_vae.init_vae(wan_vae.VAE_PRESETS["tiny"], jax.random.key(6))
  target = wan_vae.init_vae(wan_vae.VAE_PRESETS["tiny"], jax.random.key(7))
  real, seen = long_clips.stationary_latents, []

  def recorded(encode, x):
    seen.append((x, real(encode, x)))
    return seen[-1][1]

  monkeypatch.setattr(long_clips, "stationary_latents", recorded)
  long_clips.train_vae(vae, 1e-3, seed=0, batch=1, phases=((5, 16, 1.0),), encoder=False, target=target)
  x, z = seen[0]
  pictures = jax.jit(lambda c: long_clips.encode_mean(target, c))
  np.testing.assert_allclose(z, real(pictures, x), atol=1e-5)
  assert np.abs(z - real(jax.jit(lambda c: long_clips.encode_mean(vae, c)), x)).max() > 1e-2
  scenes = [world.random_scene(np.random.default_rng(8))]
  rows = long_clips.encode_clips(None, scenes, 9, pictures=pictures)
  clip = world.render(scenes[0], frames=9)[None] * 2 - 1
  assert rows.shape == (1, 16, 3, 8, 8)
  np.testing.assert_allclose(rows, np.moveaxis(real(pictures, clip), -1, 1), atol=1e-5)


def test_vae_phases_parse_and_refuse_with_the_part_named(capsys, tmp_path):
  """`--vae-phases` gives `train_vae`'s (frames, crop, share) batches; the default text is the
  default phases; a malformed or impossible part is refused naming it."""
  assert long_clips.parse_phases("65x32:0.7,17x48:0.3") == long_clips.DECODER_PHASES
  assert long_clips.parse_phases("65x64:1") == ((65, 64, 1.0),)
  for bad in ("65x64", "64x32:1", "69x32:1", "65x30:1", "65x72:1", "65x8:1", "65x32:0", "17x48:0.3,x"):
    with pytest.raises(ValueError, match=f"--vae-phases part '{bad.split(',')[-1]}'"):
      long_clips.parse_phases(bad)
  with pytest.raises(SystemExit):  # the command line: argparse prints the part and the rule
    long_clips.main(["--out", str(tmp_path / "never-written"), "--vae-phases", "65x30:1"])
  assert "--vae-phases part '65x30:1': frames 4k + 1" in capsys.readouterr().err
  assert not (tmp_path / "never-written").exists()  # refused before anything ran


@pytest.mark.parametrize("flag", ["--latent-noise", "--object-weight"])
def test_latent_noise_refuses_a_negative_or_non_number_before_anything_runs(capsys, tmp_path, flag):
  """`--latent-noise` (the decoder's latent noise std) and `--object-weight` (the shapes' extra loss
  weight) are refused when below 0 or not a finite number, naming the value, before the output
  folder is made."""
  for bad in ("-0.1", "nan", "inf", "lots"):
    with pytest.raises(SystemExit):
      long_clips.main(["--out", str(tmp_path / "never-written"), flag, bad])
    assert f"'{bad}' must be a finite number >= 0" in capsys.readouterr().err
  assert not (tmp_path / "never-written").exists()


@pytest.mark.parametrize("flag", ["--batch", "--vae-batch"])
def test_batch_refuses_a_non_positive_or_non_integer_before_anything_runs(capsys, tmp_path, flag):
  """`--batch` (the transformer's rows per step) and `--vae-batch` (the VAE's clips per step) are
  refused below 1 or when not a whole number, naming the value, before the output folder is made;
  a valid one parses."""
  for bad in ("0", "-4", "2.5", "many"):
    with pytest.raises(SystemExit):
      long_clips.main(["--out", str(tmp_path / "never-written"), flag, bad])
    assert f"'{bad}' must be a whole number >= 1" in capsys.readouterr().err
  assert not (tmp_path / "never-written").exists()
  assert getattr(long_clips.build_parser().parse_args(["--out", "x", flag, "128"]), flag[2:].replace("-", "_")) == 128


def test_the_vae_flags_reach_its_training(monkeypatch, tmp_path):
  """`--vae-batch`, `--object-weight` and the rest of the VAE's flags are what `train_vae` gets."""
  seen = {}

  class Stop(Exception):
    pass

  def fake_train(vae, seconds, **kwargs):
    seen.update(kwargs, seconds=seconds)
    raise Stop
  monkeypatch.setattr(long_clips, "train_vae", fake_train)
  monkeypatch.setattr(long_clips, "long_reconstruction", lambda *a, **k: {"error_by_8_frames": []})
  with pytest.raises(Stop):
    long_clips.main(["--out", str(tmp_path / "run"), "--vae-fraction", "1", "--minutes", "2", "--keep-encoder",
                     "--vae-batch", "6", "--object-weight", "16", "--vae-lr", "2e-4", "--vae-phases", "17x64:1"])
  assert seen["batch"] == 6 and seen["object_weight"] == 16.0 and seen["lr"] == 2e-4 and seen["seconds"] == 120
  assert seen["encoder"] is False and seen["phases"] == ((17, 64, 1.0),)


def test_the_object_weight_weighs_the_shapes_pixels():
  """`object_weight` scales the shapes' share of the decoder's loss: the same batch (same seed) at
  weight 0 (a plain MSE) and 16 gives different losses, and the weights are 1 + W on the shapes'
  pixels, 1 elsewhere."""
  vae = wan_vae.init_vae(wan_vae.VAE_PRESETS["tiny"], jax.random.key(6))
  losses = [long_clips.train_vae(vae, 1e-3, seed=0, batch=1, phases=((5, 16, 1.0),), encoder=False,
                                 object_weight=w)[1][0][2] for w in (0.0, 16.0)]
  assert abs(losses[0] - losses[1]) > 1e-3 * losses[0], losses
  clip = world.render(world.random_scene(np.random.default_rng(3)), frames=5)[None] * 2 - 1
  w = np.asarray(train_tiny.object_weights(jnp.asarray(clip), 16.0))[..., 0]
  assert set(np.unique(w)) == {1.0, 17.0} and 0 < (w == 17.0).mean() < 0.5


def test_given_first_frame_rows_are_ti2v_sampling_inputs():
  """A row given 1 frame: its first latent frame is the clean one, its first frame's tokens (Hl Wl / 4
  with patch (1, 2, 2)) have timestep 0, the rest 1000 sigma (diffusers' expand_timesteps mask), and
  the loss weight leaves that frame out; a row given 2 (a window continuing the one before) the same
  on its first 2 frames, what `TI2VConditioning` feeds sampling with 2 given frames; a row not given
  is the plain flow pair with a flat timestep."""
  rng = np.random.default_rng(0)
  x0, noise = (jnp.asarray(rng.standard_normal((3, 4, 3, 4, 4)).astype(np.float32)) for _ in range(2))
  sigma = jnp.asarray([0.5, 0.8, 0.3], jnp.float32)
  xt, _ = train_tiny.flow_pair(x0, noise, sigma)
  given = jnp.asarray([1.0, 0.0, 2.0])
  out, timestep, weight = train_tiny.given_first_frame(x0, xt, sigma, given, (1, 2, 2))
  np.testing.assert_array_equal(out[0, :, 0], x0[0, :, 0])
  np.testing.assert_array_equal(out[0, :, 1:], xt[0, :, 1:])
  np.testing.assert_array_equal(out[1], xt[1])
  np.testing.assert_array_equal(out[2, :, :2], x0[2, :, :2])
  np.testing.assert_array_equal(out[2, :, 2:], xt[2, :, 2:])
  assert timestep.shape == (3, 12)
  np.testing.assert_array_equal(timestep[0], [0.0] * 4 + [500.0] * 8)
  np.testing.assert_allclose(timestep[1], 800.0)
  np.testing.assert_allclose(timestep[2], [0.0] * 8 + [300.0] * 4, rtol=1e-6)
  np.testing.assert_array_equal(weight[:, 0, :, 0, 0], [[0, 1, 1], [1, 1, 1], [0, 0, 1]])
  from pipelines.wan.conditioning import TI2VConditioning  # sampling's inputs for the 2-frame row
  inputs = TI2VConditioning((1, 2, 2), x0[2:, :, :2]).transformer_inputs(xt[2:], 1000.0 * sigma[2:], cfg=False)
  np.testing.assert_array_equal(inputs.latents, out[2:])
  np.testing.assert_allclose(inputs.timestep.dense(), timestep[2:], rtol=1e-6)


def _fake_encode(calls):
  def fake_encode(vae, scenes, frames, batch=4, pictures=None):
    calls.append(frames)
    frames_l = 1 + (frames - 1) // 4
    return np.stack([np.broadcast_to(np.arange(frames_l, dtype=np.float32)[None, :, None, None] + 100 * i,
                                     (2, frames_l, 1, 1)) for i in range(len(scenes))])
  return fake_encode


def test_training_set_windows_are_slices_of_the_long_latents(monkeypatch):
  """Each long scene gives 4 windows of 5 latent frames at distinct offsets, each a slice of that
  scene's encoded 65-frame latents, with its prompt; the short clips come first; none given."""
  calls = []
  monkeypatch.setattr(long_clips, "encode_clips", _fake_encode(calls))
  latents, prompts, given = long_clips.training_set(None, np.random.default_rng(0), short=3, long=2)
  assert calls == [world.FRAMES, long_clips.LONG_FRAMES]
  assert latents.shape == (3 + 8, 2, 5, 1, 1) and len(prompts) == 11 and not given.any()
  for i in range(2):
    rows = latents[3 + 4 * i:7 + 4 * i, 0, :, 0, 0] - 100 * i
    starts = rows[:, 0]
    assert len(set(starts)) == 4 and all(0 <= s <= 12 for s in starts)
    np.testing.assert_array_equal(rows, starts[:, None] + np.arange(5))
    assert len(set(prompts[3 + 4 * i:7 + 4 * i])) == 1
  calls.clear()  # --long 0: the short clips alone, no 65-frame scene encoded
  latents, prompts, given = long_clips.training_set(None, np.random.default_rng(0), short=3, long=0)
  assert calls == [world.FRAMES] and latents.shape == (3, 2, 5, 1, 1) and len(prompts) == 3 and len(given) == 3


def test_training_set_teaches_windows_that_continue(monkeypatch):
  """With `given` 2: each scene's first window starts it (offset 0, given nothing: a video's first
  window), its 3 others start later and are given their first 2 latent frames (what a window that
  continues is given); the short clips are given nothing."""
  monkeypatch.setattr(long_clips, "encode_clips", _fake_encode([]))
  latents, _, given = long_clips.training_set(None, np.random.default_rng(0), short=3, long=5, given=2)
  np.testing.assert_array_equal(given[:3], 0)
  for i in range(5):
    starts = latents[3 + 4 * i:7 + 4 * i, 0, 0, 0, 0] - 100 * i
    assert starts[0] == 0 and all(1 <= s <= 12 for s in starts[1:]) and len(set(starts)) == 4
    np.testing.assert_array_equal(given[3 + 4 * i:7 + 4 * i], [0, 2, 2, 2])


# --- the shipped tiny-i2v (pipelines/wan/pretrained/tiny_i2v/, the default trained further by long_clips) --

def test_tiny_i2v_vae_decodes_65_frame_clips_without_blotches():
  """Clean 65-frame clips encoded and decoded as the pipeline does: with tiny-i2v's VAE (the
  default's, stationary in time) the mean absolute error of every 8-frame span stays under 0.06. Control: the
  same latents with latent frames 1-16 in reverse order decode to a video whose shape is elsewhere
  past frame 32 (error over 0.3 on the clip's shape pixels)."""
  vae = wan_vae.load_vae(f"{TINY_I2V_FOLDER}/vae")
  ours = long_clips.long_reconstruction(vae, np.random.default_rng(11), 3)
  assert max(ours["error_by_8_frames"]) < 0.06, ours
  scene = world.random_scene(np.random.default_rng(11), motion="moving slowly right")
  clip = world.render(scene, frames=long_clips.LONG_FRAMES)
  z = wan_vae.encode(vae, jnp.asarray(clip.transpose(3, 0, 1, 2)[None] * 2 - 1)).mean
  reversed_z = jnp.concatenate([z[:, :, :1], z[:, :, 1:][:, :, ::-1]], axis=2)
  video = np.clip(np.asarray(wan_vae.decode(vae, reversed_z, video_layout="BFHWC"))[0] * 0.5 + 0.5, 0, 1)
  shape = np.max(np.abs(clip - np.asarray(world.BACKGROUND)), axis=-1) > 0.25
  assert np.abs(video - clip).max(axis=-1)[32:][shape[32:]].mean() > 0.3


def test_tiny_i2v_continues_the_given_first_frame():
  """The issue's acceptance for the image model: a rendered first frame of a drawn scene (colour,
  shape, size and position drawn) and its prompt: the video's first frame is that image (mean
  absolute error < 0.06) and the shape does what the prompt says (`world.check`), for most scenes.
  Control: each video's first frame is nearer its own image than the next scene's."""
  samples = run_report.image_samples(TINY_I2V_FOLDER, np.random.default_rng(21), 8)
  errors = [s["first_frame_error"] for s in samples]
  assert max(errors) < 0.06, errors
  assert sum(s["ok"] for s in samples) >= 7, [(s["prompt"], s["seen"]) for s in samples]
  others = [float(np.abs(np.clip(s["video"][0], 0, 1) - samples[i - 1]["image"]).mean()) for i, s in enumerate(samples)]
  assert all(o > e for o, e in zip(others, errors)), (others, errors)


# Slow and still prompts for tiny-i2v's 65-frame acceptance (each scene drawn from its words).
I2V_LONG = ("a red square moving slowly right", "a green circle moving slowly left", "a blue triangle moving slowly down",
            "a yellow square moving slowly up", "a white circle moving slowly right", "a green triangle standing still")


def test_tiny_i2v_continues_a_first_frame_over_65_frames():
  """The acceptance for the image model at 65 frames: a slow scene's rendered first frame and its
  prompt, in context windows of 17 overlapping by 8 at the folder's own settings (windows that
  continue, guidance 2): frame 0 within 0.06 of the image and `world.check_long` (one shape in every
  frame, the named colour in every 16, steady progress, no jump) for at least 5 of 6. Control: the
  first frames are nearer their own images than the next scene's."""
  samples = run_report.long_image_samples(TINY_I2V_FOLDER, list(I2V_LONG), np.random.default_rng(11))
  errors = [s["first_frame_error"] for s in samples]
  assert max(errors) < 0.06, errors
  assert sum(s["ok"] for s in samples) >= 5, [(s["prompt"], s["seen"]) for s in samples]
  others = [float(np.abs(np.clip(s["video"][0], 0, 1) - samples[i - 1]["image"]).mean()) for i, s in enumerate(samples)]
  assert all(o > e for o, e in zip(others, errors)), (others, errors)


# --- the shipped default at 65 frames (pipelines/wan/pretrained/tiny_default/, trained further by long_clips) --

# Held out from long_clips' own checks (its report's long.png prompts).
HELD_OUT_LONG = ("a white triangle moving slowly up", "a yellow circle moving slowly right",
                 "a blue square moving slowly left", "a green square moving slowly down",
                 "a red circle moving slowly left", "a blue circle standing still")


def _latent_magnitude_by_frame(vae, clips):
  z = wan_vae.encode(vae, jnp.asarray(np.stack(clips).transpose(0, 4, 1, 2, 3) * 2 - 1)).mean
  return np.abs(np.asarray(z)).mean(axis=(0, 1, 3, 4))


def test_default_vae_round_trips_65_frame_clips_in_one_latent_space():
  """Clean 65-frame clips of every colour encoded and decoded as the pipeline does: every 8-frame
  span's mean absolute error < 0.06 and the long-video detector (colour, one shape, steady motion)
  passes on each; the latents' mean magnitude is the same along the clip (max / min over the 17
  latent frames < 1.3), so a context window anywhere holds what a 17-frame clip's latents are.
  Control: the same VAE made causal again (its encoder's time downsamplers summing their three
  frames, so a later latent frame sees frames the first one does not) varies along the clip (> 1.5)."""
  vae = wan_vae.load_vae(f"{TINY_DEFAULT_FOLDER}/vae")
  rng = np.random.default_rng(12)
  scenes = [world.random_scene(rng, colour=c, motion=m) for c, m in zip(
      world.COLOURS, ("moving slowly right", "moving slowly up", "moving slowly left", "standing still",
                      "moving slowly down"))]
  clips = [world.render(s, frames=long_clips.LONG_FRAMES) for s in scenes]
  for scene, clip in zip(scenes, clips):
    video = long_clips.round_trip(vae, clip)
    errors = np.abs(video - clip).mean(axis=(1, 2, 3))
    assert max(errors[i:i + 8].mean() for i in range(0, len(errors), 8)) < 0.06, (scene.prompt, errors)
    ok, seen = world.check_long(video, scene.prompt)
    assert ok, (scene.prompt, seen)
  ours = _latent_magnitude_by_frame(vae, clips)
  causal = wan_vae.WanVAE(vae.config, {name: jnp.broadcast_to(w[-1:], w.shape)
                                       if name.startswith("encoder") and name.endswith("time_conv.weight") else w
                                       for name, w in vae.params.items()})
  original = _latent_magnitude_by_frame(causal, clips)
  assert ours.max() / ours.min() < 1.3, ours
  assert original.max() / original.min() > 1.5, original


def test_default_draws_a_long_video_in_context_windows():
  """The issue's acceptance: the default at 65 frames (4x its trained 17) in context windows of 17
  frames overlapping by 8 that continue one another (windows blended at every step did not agree
  in this world: docs/measurements/training.md), held-out slow and still prompts: the named colour in every 16
  frames, exactly one shape in every frame, steady progress the named way with no jump between
  frames (`world.check_long`), for at least 5 of 6."""
  samples = run_report.long_samples(TINY_DEFAULT_FOLDER, list(HELD_OUT_LONG), seeds=(1,), context_fuse="continue",
                                    guidance_scale=long_clips.CONTINUE_GUIDANCE)
  assert sum(s["ok"] for s in samples) >= 5, [(s["prompt"], s["seen"]) for s in samples]
