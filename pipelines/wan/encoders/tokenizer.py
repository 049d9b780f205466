"""Prompt tokenisation for the UMT5 text encoder.

A real Wan checkpoint ships its tokenizer (google/umt5-xxl SentencePiece, 256,384 ids) in
`<pipeline>/tokenizer/`; it is loaded with transformers `AutoTokenizer`, a ByT5 folder (the
embedded tiny models') with `ByteTokenizer`: the same ids without importing transformers. The
built-in tiny model (`umt5.UMT5_PRESETS["tiny"]`, 384 ids) pairs with `default_tokenizer()`, ByT5's
byte tokenizer, which needs no files. Tokenisation follows diffusers' `WanPipeline._get_t5_prompt_embeds`: pad to `max_length`,
truncate, add the EOS special token, return the attention mask.
"""

from __future__ import annotations

import html
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np


def prompt_clean(text: str) -> str:
  """Wan's and diffusers' prompt cleaning: `ftfy.fix_text`, HTML-unescape twice, strip, collapse
  whitespace runs to one space.

  Source: diffusers `pipelines/wan/pipeline_wan.py` `prompt_clean` = `whitespace_clean(basic_clean(
  text))`, `basic_clean` running `ftfy.fix_text` (whenever ftfy is installed) before the unescapes;
  Wan's own `wan/modules/tokenizers.py` does the same unconditionally. `ftfy.fix_text` (default
  config) does more than repair mojibake: it maps fullwidth characters to ASCII ("，" -> ",",
  "！" -> "!"), straightens curly quotes and splits Latin ligatures ("ﬁ" -> "fi"), so prompts holding
  them (Wan's Chinese default negative prompt is full of fullwidth commas) tokenise differently
  without it. ftfy is therefore a dependency (pyproject.toml), not optional.

  Args:
    text: one prompt (str).

  Returns:
    The cleaned prompt (str).

  Raises:
    ImportError: ftfy is not installed; the message says how to install it.
  """
  try:
    import ftfy
  except ImportError as e:
    raise ImportError("prompt cleaning needs ftfy (as Wan's tokenizer and diffusers' WanPipeline "
                      "use it); install it with `pip install ftfy`") from e
  text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
  return re.sub(r"\s+", " ", text).strip()


class TokenizerNotFoundError(FileNotFoundError):
  """A checkpoint folder has no `tokenizer/` subfolder."""


def load_tokenizer(folder: str) -> Any:
  """Loads `folder/tokenizer/` with `transformers.AutoTokenizer`, or as a `ByteTokenizer` when it is
  a ByT5 folder (`ByteTokenizer.of_folder`: the same ids, transformers not imported).

  Args:
    folder: a diffusers pipeline folder (holding `text_encoder/`, `tokenizer/`, ...).

  Raises:
    TokenizerNotFoundError: `folder/tokenizer/` does not exist. A real checkpoint's encoder only
      understands the ids of its own tokenizer, so there is deliberately no fallback; use
      `default_tokenizer()` only with the built-in tiny encoder.
  """
  path = os.path.join(folder, "tokenizer")
  if not os.path.isdir(path):
    raise TokenizerNotFoundError(
        f"{folder!r} has no tokenizer/ folder; a real Wan checkpoint needs its UMT5 tokenizer "
        "(download the pipeline's tokenizer/ next to text_encoder/). The ByT5 default_tokenizer() "
        "only fits the built-in tiny encoder.")
  byte_tokenizer = ByteTokenizer.of_folder(path)
  if byte_tokenizer is not None:
    return byte_tokenizer
  import transformers
  return transformers.AutoTokenizer.from_pretrained(path)


class ByteTokenizer:
  """transformers' `ByT5Tokenizer` of a saved folder for `tokenize`'s two calls, without importing
  transformers (that import is seconds of a tiny model's start, more than its whole warm run).

  ByT5 (Xue et al. 2022; transformers `tokenization_byt5.py`): UTF-8 byte b is id b + 3, pad 0,
  eos 1, unk 2; `add_special_tokens` appends eos; `truncation` keeps max_length - 1 ids before it;
  `padding="max_length"` pads with 0 on the right, mask 0 there. A text holding one of the folder's
  added tokens as a substring ("</s>", "<extra_id_0>", ...: transformers splits those out as single
  ids) and any other call go to transformers' own tokenizer of the folder, so every call equals it
  (tests compare both on the same calls).
  """
  OFFSET, PAD, EOS = 3, 0, 1
  transformers_class = "ByT5Tokenizer"  # what a saved folder's model_index.json names

  def __init__(self, folder: str, added: Sequence[str], model_max_length: Any) -> None:
    self.folder, self.added, self.model_max_length = folder, tuple(added), model_max_length
    self._reference: Any = None

  @classmethod
  def of_folder(cls, path: str) -> "ByteTokenizer | None":
    """The tokenizer of `path` (a saved tokenizer folder) when its config names `ByT5Tokenizer`
    with pad / eos / unk at 0 / 1 / 2, else None."""
    import json
    try:
      with open(os.path.join(path, "tokenizer_config.json")) as f:
        config = json.load(f)
    except (OSError, ValueError):
      return None
    decoder = config.get("added_tokens_decoder", {})
    specials = [decoder.get(str(i), {}).get("content") for i in range(3)]
    sides = {config.get("padding_side", "right"), config.get("truncation_side", "right")}
    if config.get("tokenizer_class") != "ByT5Tokenizer" or specials != ["<pad>", "</s>", "<unk>"] or sides != {"right"}:
      return None
    added = [t["content"] for t in decoder.values()] + list(config.get("extra_special_tokens", []))
    return cls(path, added, config.get("model_max_length"))

  def reference(self) -> Any:
    """transformers' tokenizer of the folder (imported on first use)."""
    if self._reference is None:
      import transformers
      self._reference = transformers.AutoTokenizer.from_pretrained(self.folder)
    return self._reference

  def __call__(self, texts: Sequence[str], **kwargs: Any) -> dict[str, Any]:
    fast = (set(kwargs) <= {"padding", "max_length", "truncation", "add_special_tokens", "return_attention_mask",
                            "return_tensors"} and kwargs.get("add_special_tokens", True)
            and kwargs.get("return_attention_mask", True) and not isinstance(texts, str)
            and all(isinstance(text, str) and not any(token in text for token in self.added) for text in texts))
    if kwargs.get("padding", False):
      fast = fast and kwargs["padding"] == "max_length" and kwargs.get("truncation") is True and \
          kwargs.get("return_tensors") == "np" and isinstance(kwargs.get("max_length"), int) and kwargs["max_length"] > 0
    elif fast:
      fast = not kwargs.get("truncation") and kwargs.get("return_tensors") is None
    if not fast:
      return self.reference()(list(texts), **kwargs)
    ids = [[b + self.OFFSET for b in text.encode("utf-8")] for text in texts]
    if not kwargs.get("padding", False):
      rows = [row + [self.EOS] for row in ids]
      return {"input_ids": rows, "attention_mask": [[1] * len(row) for row in rows]}
    length = kwargs["max_length"]
    out = np.full((len(ids), length), self.PAD, np.int64)
    mask = np.zeros((len(ids), length), np.int64)
    for i, row in enumerate(ids):
      row = row[:length - 1] + [self.EOS]
      out[i, :len(row)], mask[i, :len(row)] = row, 1
    return {"input_ids": out, "attention_mask": mask}

  def save_pretrained(self, path: str) -> Any:
    """transformers' `save_pretrained` of the folder's tokenizer (with this `model_max_length`)."""
    reference = self.reference()
    if self.model_max_length is not None:  # as set on this object (training sets it)
      reference.model_max_length = self.model_max_length
    return reference.save_pretrained(path)


# Wan's prompt length in tokens (diffusers `WanPipeline.__call__(max_sequence_length=512)`).
WAN_TEXT_LENGTH = 512


def text_length(model_max_length: Any) -> int:
  """The default `max_sequence_length` for a tokenizer whose `model_max_length` is given: that
  value when it is an int below 512 (a model trained on shorter padded prompts, e.g. the trained
  tiny default: 64; Wan's cross-attention has no text mask, so the zero padding a model was trained
  with is part of its input), else Wan's 512 (the UMT5 tokenizers say 10^30: "no limit")."""
  if isinstance(model_max_length, int) and not isinstance(model_max_length, bool) and \
     0 < model_max_length < WAN_TEXT_LENGTH:
    return model_max_length
  return WAN_TEXT_LENGTH


def folder_text_length(folder: str) -> int:
  """`text_length` of `folder/tokenizer/tokenizer_config.json`'s `model_max_length` (no tokenizer
  built); 512 when the file or the key is missing."""
  import json
  try:
    with open(os.path.join(folder, "tokenizer", "tokenizer_config.json")) as f:
      return text_length(json.load(f).get("model_max_length"))
  except (OSError, ValueError, AttributeError):
    return WAN_TEXT_LENGTH


def default_tokenizer() -> Any:
  """ByT5 byte tokenizer (384 ids, pad 0, eos 1), for the built-in tiny encoder; reads no files."""
  import transformers
  return transformers.ByT5Tokenizer()


def tokenize(tokenizer: Any, prompts: Sequence[str], max_length: int) -> tuple[np.ndarray, np.ndarray]:
  """Tokenises prompts as WanPipeline does.

  Returns:
    (input_ids, attention_mask): int32 [B, L] each, L = max_length; mask 1 for real tokens.

  Raises:
    ValueError: no prompts or `max_length` < 1.
  """
  if isinstance(prompts, str):
    prompts = [prompts]
  if not prompts or max_length < 1:
    raise ValueError(f"need at least one prompt and max_length >= 1; got {len(prompts)=} {max_length=}")
  out = tokenizer(list(prompts), padding="max_length", max_length=max_length, truncation=True,
                  add_special_tokens=True, return_attention_mask=True, return_tensors="np")
  full = tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
  cut = [i for i, ids in enumerate(full) if len(ids) > max_length]
  if cut:
    # diffusers' Wan pipeline truncates silently; say so, since the video ignores the rest.
    warnings.warn(f"prompt(s) {cut} are longer than max_sequence_length={max_length} tokens "
                  f"({[len(full[i]) for i in cut]} tokens) and were truncated; raise "
                  "max_sequence_length or shorten them", stacklevel=2)
  return out["input_ids"].astype(np.int32), out["attention_mask"].astype(np.int32)
