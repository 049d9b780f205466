"""A model folder's own sampling defaults (`generation_defaults.json`): read by the Python call, the
command and the server alike; a folder without the file keeps diffusers' defaults; a bad file is
refused naming the key; a small model's prompt world warns for prompts outside it."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

from pipelines.commands import presets
from pipelines.wan.pretrained import TINY_FOLDERS, GenerationDefaults, PromptWorld
from pipelines.wan.pretrained.generation_defaults import FILE

WORLD_NOTE_START = "prompt(s) ['a cat playing piano'] are outside what the 'tiny' model was trained on"

WORLD = PromptWorld("a {colour} {shape} {motion}", (("colour", ("red", "green")), ("shape", ("square", "circle")),
                                                    ("motion", ("moving up", "standing still"))))


def test_a_folder_without_the_file_keeps_diffusers_defaults(tmp_path):
  d = GenerationDefaults.read(str(tmp_path))
  assert (d.height, d.width, d.num_frames, d.num_inference_steps, d.guidance_scale, d.context_fuse) == (
      480, 832, 81, 50, 5.0, "pyramid")
  assert d.prompt_world is None and presets.model_preset(str(tmp_path)) == presets.FOLDER_DEFAULTS


def test_the_tiny_folders_carry_the_settings_they_were_trained_at():
  """64 x 64 x 17, 8 steps, guidance 2 (end_to_end/train/tiny.py's acceptance), windows continued;
  `PRESETS["tiny"]` is read from the same file (one owner)."""
  for name, folder in TINY_FOLDERS.items():
    d = GenerationDefaults.read(folder)
    assert (d.height, d.width, d.num_frames, d.num_inference_steps, d.guidance_scale, d.context_fuse, d.fps) == (
        64, 64, 17, 8, 2.0, "continue", 16), name
    assert d.prompt_world is not None and d.prompt_world.knows("a green circle moving down")
    preset = presets.model_preset(name)
    assert (preset.width, preset.height, preset.frames, preset.steps, preset.guidance) == (64, 64, 17, 8, (2.0,))
  tiny = presets.PRESETS["tiny"]
  assert (tiny.width, tiny.frames, tiny.steps, tiny.guidance, tiny.shift) == (64, 17, 8, (2.0,), 3.0)


@pytest.mark.parametrize("data,message", [
    ({"guidance": 2}, r"unknown key\(s\) \['guidance'\]"),
    ({"height": 64.5}, r"height=64.5 must be a positive int"),
    ({"num_inference_steps": True}, r"num_inference_steps=True must be a positive int"),
    ({"context_fuse": "blend"}, r"context_fuse='blend' must be one of"),
    ({"prompt_world": {"template": "a {colour} thing"}}, r"needs one non-empty word list per \{slot\}"),
    ([1, 2], r"must hold a JSON object"),
])
def test_a_bad_file_is_refused_naming_the_key(tmp_path, data, message):
  (tmp_path / FILE).write_text(json.dumps(data))
  with pytest.raises(ValueError, match=message):
    GenerationDefaults.read(str(tmp_path))
  (tmp_path / FILE).write_text("{not json")
  with pytest.raises(ValueError, match="is not JSON"):
    GenerationDefaults.read(str(tmp_path))


def test_comments_are_allowed_and_the_source_defaults_to_the_file(tmp_path):
  (tmp_path / FILE).write_text(json.dumps({"_comment": "mine", "guidance_scale": 3.5, "height": 96}))
  d = GenerationDefaults.read(str(tmp_path))
  assert (d.guidance_scale, d.height, d.width) == (3.5, 96, 832) and d.source.endswith(FILE)


def test_prompt_world_knows_its_prompts_and_names_itself_for_others():
  """Case, spaces and a final full stop aside; the positive control: every word of another prompt is
  in the lists but the order is not the template's, and an unknown colour."""
  assert WORLD.knows("A red square moving up.") and WORLD.knows("  a green circle   standing still")
  assert not WORLD.knows("a square red moving up") and not WORLD.knows("a purple square moving up")
  note = WORLD.outside("tiny", ["a red square moving up", "a cat playing piano"])
  assert note.startswith("prompt(s) ['a cat playing piano'] are outside what the 'tiny' model was trained on")
  assert "'a {colour} {shape} {motion}'" in note and "colour: red, green" in note and "e.g. 'a red square moving up'" in note
  assert WORLD.outside("tiny", ["a green circle standing still"]) is None


def test_the_python_call_uses_the_folder_defaults_and_warns_outside_its_world(tmp_path):
  """`WanPipeline.tiny()` with nothing but a prompt: 64 x 64 x 17, 8 steps, guidance 2 (diffusers'
  defaults were 480 x 832 x 81 at 5); given values win; an out-of-world prompt warns once, an
  in-world one does not (positive control); the same folder without its file takes diffusers'."""
  from pipelines.pipeline import WanPipeline

  pipe = WanPipeline.tiny()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    request = pipe.check_inputs("a green circle moving down", seed=1)
    assert (request.height, request.width, request.num_frames, request.steps, request.guidance) == (
        64, 64, 17, 8, (2.0, 2.0))
    assert not caught
    windowed = pipe.check_inputs("a green circle moving slowly down", seed=1, num_frames=65, context_frames=17)
    assert windowed.windows.fuse == "continue"
    pipe.check_inputs("a cat playing piano", seed=1)
  notes = [str(w.message) for w in caught]
  assert len(notes) == 1 and notes[0].startswith(WORLD_NOTE_START), notes
  asked = pipe.check_inputs("a green circle moving down", seed=1, guidance_scale=5.0, num_inference_steps=4)
  assert asked.guidance == (5.0, 5.0) and asked.steps == 4
  plain = tmp_path / "plain"
  shutil.copytree(TINY_FOLDERS["tiny"], plain)
  (plain / FILE).unlink()
  facts = WanPipeline.from_pretrained(str(plain)).facts
  assert facts.defaults == GenerationDefaults()
  assert presets.model_preset(str(plain)) == presets.FOLDER_DEFAULTS



def test_training_writes_the_shipped_files_and_they_read_back_equal(tmp_path):
  """`end_to_end.train.tiny.GENERATION_DEFAULTS` is what both shipped folders hold (a retrain writes
  it again through `save_pipeline`), and `to_dict` / `from_dict` round-trip it."""
  from end_to_end.train import tiny
  from pipelines.wan.pretrained.saving import write_json

  for folder in TINY_FOLDERS.values():
    assert GenerationDefaults.read(folder) == tiny.GENERATION_DEFAULTS
  assert GenerationDefaults.from_dict(tiny.GENERATION_DEFAULTS.to_dict()) == tiny.GENERATION_DEFAULTS
  write_json(tiny.GENERATION_DEFAULTS.to_dict(), str(tmp_path / FILE))
  assert GenerationDefaults.read(str(tmp_path)) == tiny.GENERATION_DEFAULTS
