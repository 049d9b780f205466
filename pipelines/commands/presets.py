"""The published sampling defaults both commands start from (`generate`'s --preset; `serve`, for what
a job leaves out): `PRESETS` (one per Wan release and the tiny model), `FOLDER_DEFAULTS` (a folder
without --preset), the embedded model names and the default text length of a model. Imports no JAX.
"""

from __future__ import annotations

import dataclasses
import os

from pipelines.wan.pretrained import TINY_FOLDERS, GenerationDefaults


@dataclasses.dataclass(frozen=True)
class Preset:
  """Published sampling defaults of a Wan release.

  Attributes:
    width, height: pixels.
    frames: video frames (4k + 1).
    steps: denoising steps.
    shift: flow shift of the scheduler.
    guidance: one CFG scale, or (high-noise, low-noise) for the two Wan 2.2 experts.
    source: where the numbers come from.
    negative_prompt: the negative prompt when none is given (Wan's scripts use `WAN_NEGATIVE_PROMPT`).
    fps: frames per second of the output when --fps is not given (Wan 2.1 and 2.2 A14B: 16).
    scheduler: the sampler ("unipc", "euler", "dpm++"), or None for the model folder's.
    timesteps: a custom schedule (`GenerationRequest`'s `timesteps`), or None; used when neither
      --steps nor --timesteps / --sigmas is given.
  """
  width: int
  height: int
  frames: int
  steps: int
  shift: float
  guidance: tuple[float, ...]
  source: str
  negative_prompt: str = ""
  fps: float = 16.0
  scheduler: str | None = None
  timesteps: tuple[float, ...] | None = None

  def __post_init__(self):
    if len(self.guidance) not in (1, 2):
      raise ValueError(f"{self.guidance=} needs one scale or two (high-noise, low-noise expert)")
    if self.timesteps is not None and len(self.timesteps) != self.steps:
      raise ValueError(f"{self.timesteps=} must hold {self.steps=} values")


# Wan's default negative prompt: Wan2.1 / Wan2.2 `wan/configs/shared_config.py` `sample_neg_prompt`,
# which their generate.py uses when no negative prompt is given.
WAN_NEGATIVE_PROMPT = (
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，"
    "JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，"
    "手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")

# The trained tiny default's own defaults (its folder's generation_defaults.json), read once.
TINY_DEFAULTS = GenerationDefaults.read(TINY_FOLDERS["tiny"])
# A folder without --preset: diffusers WanPipeline.__call__ defaults, shift from scheduler/.
FOLDER_DEFAULTS = Preset(832, 480, 81, 50, 0.0, (5.0,), "diffusers WanPipeline.__call__ defaults")


def preset_of(defaults: GenerationDefaults, shift: float = 0.0) -> Preset:
  """A model folder's own defaults (`generation_defaults.json`) as a `Preset` (shift 0: the scheduler
  config's; fps: the folder's, else `FOLDER_DEFAULTS`')."""
  guidance = (defaults.guidance_scale,) if defaults.guidance_scale_2 is None else (
      defaults.guidance_scale, defaults.guidance_scale_2)
  return Preset(defaults.width, defaults.height, defaults.num_frames, defaults.num_inference_steps, shift, guidance,
                defaults.source, fps=FOLDER_DEFAULTS.fps if defaults.fps is None else defaults.fps)


PRESETS: dict[str, Preset] = {
    # diffusers Wan docs / Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler config (flow_shift 3.0 at 480p).
    "wan2.1-t2v-1.3b": Preset(832, 480, 81, 50, 3.0, (5.0,), "diffusers WanPipeline docs (480p: shift 3.0)",
                              WAN_NEGATIVE_PROMPT),
    # Wan2.1 generate.py defaults for t2v-14B (shift 5.0, guide scale 5.0, 50 steps) at 1280*720.
    "wan2.1-t2v-14b": Preset(1280, 720, 81, 50, 5.0, (5.0,), "Wan2.1 generate.py; diffusers docs (720p: shift 5.0)",
                             WAN_NEGATIVE_PROMPT),
    # Wan 2.1 T2V 14B with lightx2v's 4-step distillation LoRA (lightx2v configs/distill/wan21/
    # wan_t2v_distill_lora_4step_cfg.json: 480x832 x 81, 4 steps, denoising_step_list [1000, 750,
    # 500, 250], sample_shift 5, enable_cfg false; its WanStepDistillScheduler is flow-match Euler).
    "wan2.1-t2v-14b-distill": Preset(832, 480, 81, 4, 5.0, (1.0,), "lightx2v configs/distill/wan21 (4-step LoRA)",
                                     scheduler="euler", timesteps=(1000.0, 750.0, 500.0, 250.0)),
    # Wan2.2 wan/configs/wan_t2v_A14B.py: sample_shift 12.0, 40 steps, sample_guide_scale (3.0 low
    # noise, 4.0 high noise), boundary 0.875 (read from the folder's model_index.json).
    "wan2.2-t2v-a14b": Preset(1280, 720, 81, 40, 12.0, (4.0, 3.0), "Wan2.2 configs/wan_t2v_A14B.py",
                              WAN_NEGATIVE_PROMPT),
    # Wan2.2 wan/configs/wan_ti2v_5B.py: sample_shift 5.0, 50 steps, sample_guide_scale 5.0,
    # frame_num 121, sample_fps 24 (`fps`); its size list is 1280*704 / 704*1280.
    "wan2.2-ti2v-5b": Preset(1280, 704, 121, 50, 5.0, (5.0,), "Wan2.2 configs/wan_ti2v_5B.py",
                             WAN_NEGATIVE_PROMPT, fps=24.0),
    # The embedded tiny models: the settings the trained default was trained and accepted at
    # (end_to_end/train/tiny.py), read from its folder's generation_defaults.json; shift 3.0, its
    # scheduler_config.json's. Seconds on a laptop CPU.
    "tiny": preset_of(TINY_DEFAULTS, shift=3.0),
    # Image-to-video. Wan2.1 generate.py: i2v 40 steps, shift 3.0 at 832*480 and 5.0 otherwise,
    # guide scale 5.0; flf2v 50 steps, shift 16. Without --size the video takes the image's aspect
    # ratio within width x height's area (`size_for_image`, as Wan's image2video.py).
    "wan2.1-i2v-14b-480p": Preset(832, 480, 81, 40, 3.0, (5.0,), "Wan2.1 generate.py (i2v-14B, 832*480)",
                                  WAN_NEGATIVE_PROMPT),
    "wan2.1-i2v-14b-720p": Preset(1280, 720, 81, 40, 5.0, (5.0,), "Wan2.1 generate.py (i2v-14B, 1280*720)",
                                  WAN_NEGATIVE_PROMPT),
    "wan2.1-flf2v-14b-720p": Preset(1280, 720, 81, 50, 16.0, (5.0,), "Wan2.1 generate.py (flf2v-14B, 1280*720)",
                                    WAN_NEGATIVE_PROMPT),
    # Wan2.2 wan/configs/wan_i2v_A14B.py: shift 5.0, 40 steps, guide scale (3.5, 3.5), boundary 0.900
    # (read from the folder's model_index.json).
    "wan2.2-i2v-a14b": Preset(1280, 720, 81, 40, 5.0, (3.5, 3.5), "Wan2.2 configs/wan_i2v_A14B.py",
                              WAN_NEGATIVE_PROMPT),
    # VACE. Wan2.1 generate.py: vace-1.3B / vace-14B 50 steps, shift 16 (as flf2v), guide scale
    # 5.0, 81 frames; vace-1.3B at 832*480 (its sizes: 480p only), vace-14B at 1280*720.
    "wan2.1-vace-1.3b": Preset(832, 480, 81, 50, 16.0, (5.0,), "Wan2.1 generate.py (vace-1.3B, 832*480)",
                               WAN_NEGATIVE_PROMPT),
    "wan2.1-vace-14b": Preset(1280, 720, 81, 50, 16.0, (5.0,), "Wan2.1 generate.py (vace-14B, 1280*720)",
                              WAN_NEGATIVE_PROMPT),
    # Wan 2.2 VACE-Fun A14B (two experts, boundary 0.900 from the folder's model_index.json): lightx2v
    # configs/wan22_vace/a800/bf16/wan22_moe_vace.json: 832*480 x 81, 40 steps, sample_shift 8,
    # sample_guide_scale (3.5, 3.5).
    "wan2.2-vace-fun-a14b": Preset(832, 480, 81, 40, 8.0, (3.5, 3.5), "lightx2v configs/wan22_vace (VACE-Fun A14B)",
                                   WAN_NEGATIVE_PROMPT),
}
# The embedded models (`--model`): the trained default, the same run with a first frame given
# (TI2V-style, `--image`), and the random-weight one.
TINY_MODELS = ("tiny", "tiny-i2v", "tiny-random")


def default_text_length(model: str) -> int:
  """Text tokens per prompt when none are asked for: the length `model` (a `TINY_MODELS` name or a
  folder) was trained with, from its tokenizer's `model_max_length` (`tokenizer.folder_text_length`:
  64 for the trained tiny default, 512 for Wan folders); Wan's 512 for the random-weight tiny model.
  Reads one JSON file at most; loads no model."""
  from pipelines.wan.encoders import WAN_TEXT_LENGTH, folder_text_length
  if model == "tiny-random":
    return WAN_TEXT_LENGTH
  if model in ("tiny", "tiny-i2v"):
    from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER, TINY_I2V_FOLDER
    model = TINY_I2V_FOLDER if model == "tiny-i2v" else TINY_DEFAULT_FOLDER
  return folder_text_length(model)


def size_for_image(image_height: int, image_width: int, area: int, multiple: int) -> tuple[int, int]:
  """(width, height) of a video with the image's aspect ratio and about `area` pixels, each a
  multiple of `multiple` (the VAE's spatial factor x the patch), floored as Wan2.1
  wan/image2video.py does: h = floor(sqrt(area * ar) / multiple) * multiple, ar = H / W."""
  ratio = image_height / image_width
  height = int((area * ratio) ** 0.5 // multiple) * multiple
  width = int((area / ratio) ** 0.5 // multiple) * multiple
  return max(width, multiple), max(height, multiple)


def model_preset(model: str | None) -> Preset:
  """The sampling defaults of `model` (a `TINY_MODELS` name, a folder, or None: single files) when no
  --preset is given: its folder's `generation_defaults.json` (the tiny models': `PRESETS["tiny"]`'s
  numbers), else diffusers' (`FOLDER_DEFAULTS`; also for a Hub id before its download).

  Raises:
    ValueError: a folder's defaults file that is not valid (`GenerationDefaults.read`).
  """
  folder = TINY_FOLDERS.get(model, model) if model is not None else None
  if folder is None or not os.path.isdir(folder):
    return FOLDER_DEFAULTS
  return preset_of(GenerationDefaults.read(folder))




def model_fps(expand_timesteps: bool) -> float:
  """The frame rate a folder's model was trained at, for a video without --fps or --preset: 24 for
  Wan 2.2 TI2V-5B (one timestep per token, `expand_timesteps`; configs/wan_ti2v_5B.py sample_fps),
  else 16 (Wan 2.1, Wan 2.2 A14B). Played at another rate, the motion runs fast or slow."""
  return 24.0 if expand_timesteps else FOLDER_DEFAULTS.fps
