"""Tests for pipelines/wan/encoders/tokenizer.py `prompt_clean`: equal to diffusers' and Wan's (ftfy first).

Reference: diffusers `pipelines/wan/pipeline_wan.py` `prompt_clean` with ftfy installed (its
`basic_clean` runs `ftfy.fix_text` whenever `is_ftfy_available()`), and the token ids its
`_get_t5_prompt_embeds` builds from the cleaned text (padding to max_length, truncation, EOS).
The full-pipeline check against diffusers with these prompts is in tests/pipelines/pipeline/test_wan_pipeline.py
(`test_wan_negative_prompt_matches_diffusers`).
"""

from __future__ import annotations

import contextlib
import os
import html
import re
import warnings

import numpy as np
import pytest

from pipelines.wan.encoders import tokenizer

pytest.importorskip("ftfy")
pipeline_wan = pytest.importorskip("diffusers.pipelines.wan.pipeline_wan")
transformers = pytest.importorskip("transformers")

# Wan's default negative prompt: Wan2.1 `wan/configs/shared_config.py` `sample_neg_prompt`, used by
# its generate.py when no negative prompt is given (diffusers' WanPipeline docstring example holds
# its English translation, below). Full of fullwidth commas, which ftfy maps to ",".
from pipelines.commands.presets import WAN_NEGATIVE_PROMPT as PRESETS_NEGATIVE  # noqa: E402
WAN_NEGATIVE_PROMPT = (
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，"
    "JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，"
    "手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")
DIFFUSERS_NEGATIVE_PROMPT = (
    "Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, images, "
    "static, overall gray, worst quality, low quality, JPEG compression residue, ugly, incomplete, extra "
    "fingers, poorly drawn hands, poorly drawn faces, deformed, disfigured, misshapen limbs, fused "
    "fingers, still picture, messy background, three legs, many people in the background, walking "
    "backwards")
# Curly quotes, fullwidth letters and punctuation, Latin ligatures, mojibake, HTML entities, whitespace.
TRICKY_PROMPTS = [
    "the \u201cfirst\u201d dog\u2019s \u2018bone\u2019",
    "\uff21 \uff52\uff45\uff44 \uff46\uff4f\uff58\uff01 running\uff08fast\uff09\uff1a snow\uff1f",
    "a \ufb01sh and a \ufb02ower in an o\ufb03ce",
    "caf\u00c3\u00a9 at night",  # "café" read as Latin-1: mojibake ftfy repairs
    "  two &amp; cats\n on a   roof ",
    "plain ascii prompt",
]
PROMPTS = [WAN_NEGATIVE_PROMPT, DIFFUSERS_NEGATIVE_PROMPT] + TRICKY_PROMPTS


def _clean_without_ftfy(text: str) -> str:
  """The cleaning before ftfy was applied (HTML-unescape twice, whitespace): the positive control."""
  return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()


@contextlib.contextmanager
def _no_warning():
  """Fails on any UserWarning (a 512-token run truncates nothing)."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)
    yield


def _diffusers_ids(tok, prompts: list[str], max_length: int) -> np.ndarray:
  """Token ids as diffusers' `WanPipeline._get_t5_prompt_embeds` builds them."""
  cleaned = [pipeline_wan.prompt_clean(p) for p in prompts]
  out = tok(cleaned, padding="max_length", max_length=max_length, truncation=True,
            add_special_tokens=True, return_attention_mask=True, return_tensors="np")
  return out["input_ids"]


def test_diffusers_runs_ftfy_here():
  """The comparisons below are against diffusers' ftfy path (what Wan always does)."""
  assert pipeline_wan.is_ftfy_available()


@pytest.mark.parametrize("text", PROMPTS, ids=range(len(PROMPTS)))
def test_prompt_clean_matches_diffusers(text):
  assert tokenizer.prompt_clean(text) == pipeline_wan.prompt_clean(text)


def test_prompt_clean_maps_what_ftfy_maps():
  """The kinds of characters named in the docstring: fullwidth -> ASCII, quotes straightened,
  ligatures split, mojibake repaired, entities unescaped, whitespace collapsed."""
  clean = tokenizer.prompt_clean
  assert clean("静态，细节") == "静态,细节"
  assert clean(TRICKY_PROMPTS[0]) == "the \"first\" dog's 'bone'"
  assert clean(TRICKY_PROMPTS[1]) == "A red fox! running(fast): snow?"
  assert clean(TRICKY_PROMPTS[2]) == "a fish and a flower in an office"
  assert clean(TRICKY_PROMPTS[3]) == "café at night"
  assert clean(TRICKY_PROMPTS[4]) == "two & cats on a roof"


@pytest.mark.parametrize("max_length", [32, 512])
def test_token_ids_match_diffusers(max_length):
  """Ours (`tokenize` of `prompt_clean`) vs diffusers' ids, with the byte tokenizer of the tiny
  models; positive control: the cleaning without ftfy gives other ids for most of these prompts
  (it would fail this test), so the equality is not vacuous."""
  tok = tokenizer.default_tokenizer()
  with pytest.warns(UserWarning, match="truncated") if max_length == 32 else _no_warning():
    ours, _ = tokenizer.tokenize(tok, [tokenizer.prompt_clean(p) for p in PROMPTS], max_length)
  ref = _diffusers_ids(tok, PROMPTS, max_length)
  np.testing.assert_array_equal(ours, ref)
  old = tok([_clean_without_ftfy(p) for p in PROMPTS], padding="max_length", max_length=max_length,
            truncation=True, add_special_tokens=True, return_tensors="np")["input_ids"]
  differing = [i for i in range(len(PROMPTS)) if not np.array_equal(old[i], ref[i])]
  # Every prompt but the two English-only ones without special characters (#1, #7) and the
  # entity/whitespace one (#6, which both cleanings handle).
  assert differing == [0, 2, 3, 4, 5], differing


def test_prompt_clean_without_ftfy_says_how_to_install(monkeypatch):
  import builtins
  real_import = builtins.__import__

  def fake_import(name, *args, **kwargs):
    if name == "ftfy":
      raise ImportError("No module named 'ftfy'")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", fake_import)
  with pytest.raises(ImportError, match="pip install ftfy"):
    tokenizer.prompt_clean("a prompt")


def test_wan_presets_use_wans_default_negative_prompt():
  """generate's wan2.* presets with guidance default the negative prompt to Wan's (as Wan's
  generate.py); the tiny preset, the guidance-free distilled one and an explicit --negative-prompt
  keep theirs."""
  from pipelines.cli import flags, run_plan
  from pipelines.commands import presets
  assert PRESETS_NEGATIVE == WAN_NEGATIVE_PROMPT
  for name, preset in presets.PRESETS.items():  # guidance 1 (distilled) has no negative prompt to use
    guided = max(preset.guidance) > 1
    assert preset.negative_prompt == (WAN_NEGATIVE_PROMPT if name.startswith("wan2") and guided else ""), name
  args = flags.build_parser().parse_args(["--prompt", "a fox", "--preset", "wan2.1-t2v-1.3b", "--out", "/tmp/x.npy"])
  assert run_plan._preset(args, "tiny")[1].negative_prompt == WAN_NEGATIVE_PROMPT and args.negative_prompt is None


_BYTE_PROMPTS = ["a red square moving right", "", "  two  spaces\t", "Ünïcödé ✓ 🎬 视频，全角！", "x" * 100,
                 "</S> <extra_id_ <pad", "<"]
_ADDED_PROMPTS = ["a </s> inside", "<extra_id_3> first", "ends with <pad>", "<unk>"]


def _tiny_tokenizer_folder():
  from pipelines.wan.pretrained.embedded import TINY_DEFAULT_FOLDER
  return os.path.join(TINY_DEFAULT_FOLDER, "tokenizer")


@pytest.mark.parametrize("max_length", [1, 5, 26, 64, 200])
def test_byte_tokenizer_equals_transformers_byt5(max_length):
  """The tiny models' tokenizer without transformers, against transformers' own ByT5Tokenizer of the
  same folder on both calls `tokenize` makes: unicode, empty, whitespace, truncated and padded
  prompts and near-misses of added tokens on the fast path (it never builds transformers' tokenizer),
  then prompts holding added tokens (those calls go to transformers itself)."""
  import transformers

  path = _tiny_tokenizer_folder()
  ours = tokenizer.ByteTokenizer.of_folder(path)
  assert isinstance(tokenizer.load_tokenizer(os.path.dirname(path)), tokenizer.ByteTokenizer)
  theirs = transformers.AutoTokenizer.from_pretrained(path)
  assert type(theirs).__name__ == "ByT5Tokenizer"
  kw = dict(padding="max_length", max_length=max_length, truncation=True, add_special_tokens=True,
            return_attention_mask=True, return_tensors="np")
  for prompts in (_BYTE_PROMPTS, _ADDED_PROMPTS):
    a, b = ours(prompts, **kw), theirs(prompts, **kw)
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    np.testing.assert_array_equal(a["attention_mask"], b["attention_mask"])
    assert ours(prompts, add_special_tokens=True)["input_ids"] == theirs(prompts, add_special_tokens=True)["input_ids"]
    if prompts is _BYTE_PROMPTS:
      assert ours._reference is None  # the fast path answered both calls
  assert ours._reference is not None  # positive control: added tokens went to transformers
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the truncation warning (tested elsewhere)
    ids, mask = tokenizer.tokenize(ours, _BYTE_PROMPTS[:5], max_length)
  assert ids.dtype == np.int32 and mask.shape == ids.shape == (5, max_length)


def test_byte_tokenizer_fast_path_imports_no_transformers_and_saves_the_same_folder(tmp_path):
  """Tokenising a plain prompt with the tiny folder's tokenizer leaves transformers unimported (a
  fresh process); a prompt with an added token imports it (positive control: the check can see the
  import); saving writes a folder transformers loads to the same ids."""
  import subprocess
  import sys

  script = ("import sys; from pipelines.wan.encoders import tokenizer as t; "
            f"tok = t.load_tokenizer({os.path.dirname(_tiny_tokenizer_folder())!r}); "
            "t.tokenize(tok, [sys.argv[1]], 16); print('transformers' in sys.modules)")
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  runs = [subprocess.run([sys.executable, "-c", script, prompt], capture_output=True, text=True, env=env, check=True)
          for prompt in ("a red square", "a </s> b")]
  assert [r.stdout.strip() for r in runs] == ["False", "True"]
  ours = tokenizer.ByteTokenizer.of_folder(_tiny_tokenizer_folder())
  ours.save_pretrained(str(tmp_path))
  import transformers
  saved = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert saved.model_max_length == ours.model_max_length == 64
  assert saved(["ab"])["input_ids"] == ours(["ab"], add_special_tokens=True)["input_ids"] == [[100, 101, 1]]


def test_byte_tokenizer_only_for_byt5_folders_it_matches(tmp_path):
  """Another class, a missing folder, left padding or truncation, or specials in another order: None
  (transformers loads those); the tiny folder's own config: a ByteTokenizer (positive control)."""
  import json

  config = json.loads(open(os.path.join(_tiny_tokenizer_folder(), "tokenizer_config.json")).read())
  assert tokenizer.ByteTokenizer.of_folder(_tiny_tokenizer_folder()) is not None
  swapped = dict(config["added_tokens_decoder"])
  swapped["0"], swapped["1"] = swapped["1"], swapped["0"]
  for change in ({"tokenizer_class": "T5Tokenizer"}, {"padding_side": "left"}, {"truncation_side": "left"},
                 {"added_tokens_decoder": swapped}):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
    assert tokenizer.ByteTokenizer.of_folder(str(tmp_path)) is None, change
  assert tokenizer.ByteTokenizer.of_folder(str(tmp_path / "missing")) is None
