"""`wan.pretrained.convert`: the command's argument rules (the round trip of a folder is in
tests/pipelines/pipeline/load/test_single_file.py, where the videos are compared)."""

import pytest

from pipelines.wan.pretrained import convert


def test_source_or_files_not_both(tmp_path, capsys):
  with pytest.raises(SystemExit):
    convert.main([str(tmp_path / "dst")])
  assert "pass SOURCE (an official folder) or --transformer, --vae and --text-encoder" in capsys.readouterr().err


def test_missing_source_file_is_an_error(tmp_path, capsys):
  code = convert.main([str(tmp_path / "dst"), "--transformer", str(tmp_path / "t.safetensors"), "--vae", "v",
                       "--text-encoder", "e", "--tokenizer", str(tmp_path)])
  assert code == 1 and "t.safetensors' does not exist" in capsys.readouterr().err
  assert not (tmp_path / "dst").exists()
