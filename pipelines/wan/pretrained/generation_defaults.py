"""A model folder's own sampling defaults: `generation_defaults.json` beside its model_index.json.

A model trained for one setting (the embedded tiny models: 64x64 x 17 frames, 8 steps, guidance 2)
carries it in its folder, so that the Python call, `generate`, `serve` and its page run the same
video when a request leaves a value out. A folder without the file keeps diffusers'
`WanPipeline.__call__` defaults (`GenerationDefaults()`). The keys are diffusers' argument names,
plus `context_fuse` (the context windows' fuse, `WanPipeline.__call__`), `fps` (the output's frame
rate) and `prompt_world` (the prompts a small model knows: a prompt outside it warns). For example:

    {"height": 64, "width": 64, "num_frames": 17, "num_inference_steps": 8, "guidance_scale": 2.0,
     "context_fuse": "continue", "fps": 16,
     "prompt_world": {"template": "a {colour} {shape} {motion}", "colour": ["red", ...], ...}}

JAX-free: the commands read it before JAX starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from typing import Any

FILE = "generation_defaults.json"
CONTEXT_FUSES = ("pyramid", "flat", "continue")


@dataclasses.dataclass(frozen=True)
class PromptWorld:
  """The prompts a model was trained on: `template` with a {slot} per word list of `words`, e.g.
  "a {colour} {shape} {motion}" with (("colour", ("red", ...)), ("shape", (...)), ("motion", (...)))."""
  template: str
  words: tuple[tuple[str, tuple[str, ...]], ...]

  def __post_init__(self):
    slots = re.findall(r"{(\w+)}", self.template)
    if not slots or set(slots) != {slot for slot, _ in self.words} or any(not w for _, w in self.words):
      raise ValueError(f"prompt_world: template {self.template!r} needs one non-empty word list per {{slot}}, "
                       f"got lists for {sorted(slot for slot, _ in self.words)}")

  def knows(self, prompt: str) -> bool:
    """Whether `prompt` (case, surrounding spaces and a final full stop aside) fills the template."""
    pattern = re.escape(self.template)
    for slot, words in self.words:
      pattern = pattern.replace(re.escape("{" + slot + "}"), "(?:" + "|".join(map(re.escape, words)) + ")")
    return re.fullmatch(pattern, " ".join(prompt.strip().rstrip(".").lower().split())) is not None

  def outside(self, model: str, prompts: Sequence[str]) -> str | None:
    """The warning for the prompts the world does not know, naming its template and words, or None."""
    unknown = [p for p in prompts if not self.knows(p)]
    if not unknown:
      return None
    known = "; ".join(f"{slot}: {', '.join(words)}" for slot, words in self.words)
    return (f"prompt(s) {unknown} are outside what the {model!r} model was trained on; it draws "
            f"{self.template!r} ({known}), e.g. {self.example()!r}, and gives something else otherwise")

  def example(self) -> str:
    text = self.template
    for slot, words in self.words:
      text = text.replace("{" + slot + "}", words[0])
    return text


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
  """What a call leaves out (diffusers' `WanPipeline.__call__` defaults unless the folder says).

  Attributes:
    height, width: pixels. num_frames: frames (4k + 1). num_inference_steps: denoising steps.
    guidance_scale: the CFG scale (guidance_scale_2: a two-expert model's low-noise one, None: the same).
    context_fuse: how context windows are fused ("pyramid", "flat", "continue").
    fps: the output's frame rate, None: the model kind's (`commands.presets.model_fps`).
    prompt_world: the prompts the model knows, None: any.
    source: where these numbers come from.
  """
  height: int = 480
  width: int = 832
  num_frames: int = 81
  num_inference_steps: int = 50
  guidance_scale: float = 5.0
  guidance_scale_2: float | None = None
  context_fuse: str = "pyramid"
  fps: float | None = None
  prompt_world: PromptWorld | None = None
  source: str = "diffusers WanPipeline.__call__ defaults"

  def to_dict(self) -> dict[str, Any]:
    """The file's JSON object (`from_dict` reads it back equal)."""
    data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "prompt_world"}
    if self.prompt_world is not None:
      data["prompt_world"] = {"template": self.prompt_world.template,
                              **{slot: list(words) for slot, words in self.prompt_world.words}}
    return data

  @classmethod
  def read(cls, folder: str) -> GenerationDefaults:
    """The folder's `FILE`, or diffusers' defaults where it has none.

    Raises:
      ValueError: a file that is not a JSON object of known keys with values of their types (naming
        the file, the key and the value).
    """
    path = os.path.join(folder, FILE)
    if not os.path.isfile(path):
      return cls()
    with open(path, encoding="utf-8") as f:
      try:
        data = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e}); fix or remove it (then diffusers' defaults apply)") from None
    return cls.from_dict(data, path)

  @classmethod
  def from_dict(cls, data: Any, where: str = FILE) -> GenerationDefaults:
    """From the file's JSON object (keys starting with "_" are comments). Raises: ValueError, as `read`."""
    if not isinstance(data, dict):
      raise ValueError(f"{where} must hold a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)} | {"source": None}
    unknown = sorted(k for k in data if k not in fields and not k.startswith("_"))
    if unknown:
      raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(k for k in fields if k != 'source')}")
    values = {k: v for k, v in data.items() if not k.startswith("_")}
    for key, kind in (("height", int), ("width", int), ("num_frames", int), ("num_inference_steps", int),
                      ("guidance_scale", float), ("guidance_scale_2", float), ("fps", float)):
      value = values.get(key)
      if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                or (kind is int and not isinstance(value, int)) or value <= 0 and key != "guidance_scale"):
        raise ValueError(f"{where}: {key}={value!r} must be a positive {kind.__name__}")
    if values.get("context_fuse", "pyramid") not in CONTEXT_FUSES:
      raise ValueError(f"{where}: context_fuse={values['context_fuse']!r} must be one of {CONTEXT_FUSES}")
    world = values.pop("prompt_world", None)
    if world is not None:
      if not isinstance(world, dict) or not isinstance(world.get("template"), str):
        raise ValueError(f"{where}: prompt_world must be an object with a \"template\" and a word list per slot")
      slots = re.findall(r"{(\w+)}", world["template"])  # word lists in the template's order
      keys = sorted((k for k in world if k != "template"), key=lambda k: slots.index(k) if k in slots else len(slots))
      values["prompt_world"] = PromptWorld(world["template"], tuple((k, tuple(map(str, world[k]))) for k in keys))
    source = values.pop("source", where)
    return cls(**values, source=source)
