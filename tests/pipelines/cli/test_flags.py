"""Tests for pipelines/cli/flags.py: the values of `generate`'s flags as parsed (--size, and
--no-vae-parallel against its default); each request flag named as `GenerationRequest.build`'s
argument; --help in groups, its defaults the ones that run."""

from __future__ import annotations

import argparse
import inspect
import re

import pytest

from pipelines.cli import flags, generate, run_plan
from pipelines.pipeline.checked.request import GenerationRequest
from tests.pipelines.cli.test_generate import BASE


def test_vae_parallel_flag(tmp_path):
  """The decode is split over the mesh by default; --no-vae-parallel keeps it on one device."""
  parse = generate.build_parser().parse_args
  out = ["--out", str(tmp_path / "a.mp4")]
  assert run_plan.plan_run(parse(BASE[:-4] + out)).asked("vae_parallel") is True
  assert run_plan.plan_run(parse(BASE[:-4] + ["--no-vae-parallel"] + out)).asked("vae_parallel") is False


@pytest.mark.parametrize("text,expected", [("832x480", (832, 480)), ("1280*720", (1280, 720))])
def test_parse_size(text, expected):
  assert flags.parse_size(text) == expected


@pytest.mark.parametrize("python,command", [
    ("context windows: context_frames=81, context_overlap=20 (and W=2 in the mesh)",
     "context windows: --context-frames 81, --context-overlap 20 (and W=2 in the mesh)"),
    ("'x.mp4' exists; pass overwrite=True to replace it", "'x.mp4' exists; pass --overwrite to replace it"),
    ("longer than max_sequence_length=64 tokens; raise max_sequence_length",
     "longer than --max-sequence-length 64 tokens; raise --max-sequence-length"),
    ("context_fuse='flat', nan_guard=False, vae_parallel=False",
     "--context-fuse flat, --no-nan-guard, --no-vae-parallel"),
    # left as written (the controls): a name that --size gives with another, an on/off value the flag
    # does not set, a name no flag gives, a folder, a bare word without an underscore
    ("height=64, overwrite=False, odd_size='pad', text_encoder/, the video and mask",
     "height=64, overwrite=False, odd_size='pad', text_encoder/, the video and mask"),
])
def test_in_flags_names_the_flags_that_give_the_arguments(python, command):
  assert flags.in_flags(python) == command


# `GenerationRequest.build` arguments `generate` does not take, and why.
NOT_TAKEN = {
    "latents", "prompt_embeds", "negative_prompt_embeds", "image_embeds",  # arrays: the Python call's
    "num_videos_per_prompt",  # one video per run
    "attention_kwargs",  # the LoRA scale per call: --lora PATH:SCALE fuses it
    "generator",  # refused by the request: pass a seed
    "attention_implementation",  # a measurement knob (end_to_end), not a user choice
    "decode",  # every process that writes decodes
    "video_to_video",  # the pipeline class's kind: --video on a text-to-video model is video-to-video
}


def test_request_flags_are_named_as_build_arguments():
  """Every `build` argument the command takes has a flag whose dest is its name (or the one flag
  that gives it with another, `SHARED_FLAGS`); the two lists of exceptions name real arguments."""
  names = set(inspect.signature(GenerationRequest.build).parameters) - {"cls", "model"}  # model: its facts
  dests = {a.dest for a in generate.build_parser()._actions}
  assert NOT_TAKEN <= names and set(flags.SHARED_FLAGS) <= names, (NOT_TAKEN - names, set(flags.SHARED_FLAGS) - names)
  missing = sorted(n for n in names - NOT_TAKEN if n not in dests and flags.SHARED_FLAGS.get(n) not in dests)
  assert not missing, f"build arguments with no flag of that dest: {missing}"
  assert not NOT_TAKEN & dests, NOT_TAKEN & dests  # a flag for an argument listed as not taken
  parser = generate.build_parser()
  assert [flags.flag_of(parser, n) for n in ("num_inference_steps", "height", "guidance_scale_2", "reference_images")] == [
      "--steps", "--size", "--guidance", "--reference-image"]


def test_help_groups_hold_at_most_12_flags():
  groups = [g for g in generate.build_parser()._action_groups if g._group_actions]
  sizes = {g.title: len([a for a in g._group_actions if a.option_strings and a.dest != "help"]) for g in groups}
  assert max(sizes.values()) <= 12 and len(sizes) >= 8, sizes


def test_help_prints_the_defaults_that_run(tmp_path):
  """The tiny model's defaults that --help names are the ones a run without those flags asks for,
  and every default argparse appends is the parsed value of an absent flag."""
  text = " ".join(generate.build_parser().format_help().split())
  for flag, name in (("--size", None), ("--frames", "num_frames"), ("--steps", "num_inference_steps"),
                     ("--guidance", "guidance_scale"), ("--shift", "flow_shift")):
    entry = re.escape(flag) + r" [A-Z]+ (?:(?! --[a-z-]+ [A-Z]).)*?"  # up to the next flag's entry
    said = re.search(entry + r"default: the --preset's, (\S+) for tiny", text)
    assert said is not None, flag
    plan = run_plan.plan_run(generate.build_parser().parse_args(["--prompt", "x", "--out", str(tmp_path / "a.mp4")]))
    ran = f"{plan.asked('width')}x{plan.asked('height')}" if name is None else f"{plan.asked(name):g}"
    assert said.group(1) == ran, (flag, said.group(1), ran)
  parsed = vars(generate.build_parser().parse_args([]))
  for action in generate.build_parser()._actions:
    if action.default not in (None, argparse.SUPPRESS):
      assert parsed[action.dest] == action.default, action.dest
