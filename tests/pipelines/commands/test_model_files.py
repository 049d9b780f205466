"""The single-file model flags (pipelines/commands/model_files.py): given together and not with
--model (`single_files`), each file's record hashed once (`describe`: a digest recorded for the same
path, size and mtime is reused) and a changed file told apart from a touched one (`changed`).
The command's own runs and refusals: tests/pipelines/cli/test_generate.py."""

from __future__ import annotations

import argparse
import hashlib
import os

import pytest

from pipelines.commands import model_files
from pipelines.commands.flags import UsageError
from pipelines.storage import weights
from pipelines.wan.pretrained import Sources

LAYOUTS = {"transformer": "wan", "vae": "wan", "text_encoder": "transformers"}


def _parse(*argv: str) -> argparse.Namespace:
  p = argparse.ArgumentParser()
  p.add_argument("--model", default=None)
  model_files.add_single_file_flags(p)
  return p.parse_args(list(argv))


@pytest.fixture
def files(tmp_path) -> Sources:
  for name in ("t", "v", "te"):
    (tmp_path / f"{name}.safetensors").write_bytes(name.encode() * 100)
  (tmp_path / "tok").mkdir()
  (tmp_path / "tok" / "tokenizer.json").write_text("{}")
  return Sources(transformer=str(tmp_path / "t.safetensors"), vae=str(tmp_path / "v.safetensors"),
                 text_encoder=str(tmp_path / "te.safetensors"), tokenizer=str(tmp_path / "tok"))


def test_single_files_of_the_flags(files):
  assert model_files.single_files(_parse()) is None and model_files.single_files(_parse("--model", "tiny")) is None
  argv = ["--transformer", files.transformer, "--vae", files.vae, "--text-encoder", files.text_encoder]
  assert model_files.single_files(_parse(*argv, "--tokenizer", files.tokenizer)) == files
  with pytest.raises(UsageError, match=r"--model 'tiny' and --transformer '.*t.safetensors' both name the model"):
    model_files.single_files(_parse(*argv, "--model", "tiny"))
  with pytest.raises(UsageError, match=r"--tokenizer '.*tok' needs --transformer, --vae and --text-encoder too"):
    model_files.single_files(_parse("--tokenizer", files.tokenizer))


def _counting(monkeypatch) -> list[str]:
  hashed = []
  real = weights.file_sha256
  monkeypatch.setattr(weights, "file_sha256", lambda path, *a: hashed.append(os.path.basename(path)) or real(path, *a))
  return hashed


def test_describe_hashes_each_file_once(files, monkeypatch):
  hashed = _counting(monkeypatch)
  first = model_files.describe(files, LAYOUTS)
  assert sorted(hashed) == ["t.safetensors", "te.safetensors", "v.safetensors"]
  assert first["vae"]["sha256"] == hashlib.sha256(b"v" * 100).hexdigest() and first["vae"]["layout"] == "wan"
  assert first["transformer"]["path"] == os.path.abspath(files.transformer)
  hashed.clear()
  assert model_files.describe(files, LAYOUTS, known=first) == first and hashed == []  # the record's digests
  os.utime(files.vae, ns=(1, 1))  # touched: hashed again, the same digest
  again = model_files.describe(files, LAYOUTS, known=first)
  assert hashed == ["v.safetensors"] and again["vae"]["sha256"] == first["vae"]["sha256"]


def test_changed_tells_a_new_file_from_a_touched_one(files, monkeypatch):
  saved = model_files.describe(files, LAYOUTS)
  hashed = _counting(monkeypatch)
  assert model_files.changed(saved) == [] and hashed == []  # same size and mtime: not read
  os.utime(files.vae, ns=(1, 1))
  assert model_files.changed(saved) == [] and hashed == ["v.safetensors"]  # the same bytes
  with open(files.transformer, "wb") as f:
    f.write(b"x" * 100)
  os.remove(files.text_encoder)
  lines = model_files.changed(saved)
  assert len(lines) == 2 and lines[0].startswith(f"--transformer {os.path.abspath(files.transformer)!r} changed "
                                                 f"(SHA-256 {saved['transformer']['sha256'][:12]}... then, ")
  assert lines[1] == f"--text-encoder {os.path.abspath(files.text_encoder)!r} is gone"
