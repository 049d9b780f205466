"""The folder the random diffusers transformers of diffusers_folders.py are saved under, for every test
here that saves one (test_model.py, test_config.py, test_loading.py)."""

import pytest

from tests.pipelines.wan.transformer.diffusers_folders import _FOLDERS


@pytest.fixture(scope="session", autouse=True)
def _saved_models(tmp_path_factory):
  """Saves each random diffusers model once per session (lazily, by `_folder`)."""
  _FOLDERS["root"] = str(tmp_path_factory.mktemp("wan_transformers"))
  yield
  _FOLDERS.clear()
