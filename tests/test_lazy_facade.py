"""`lazy_facade` (lazy_facade.py): a package's `__all__` and `__getattr__` from its `_HOMES` table; a
home is imported when one of its names is first asked for, never by importing the package; and every
product facade's names resolve at their homes."""

from __future__ import annotations

import importlib
import pathlib
import sys

import pytest

from lazy_facade import lazy_facade

ROOT = pathlib.Path(__file__).resolve().parents[1]
FACADE_LINE = "__all__, __getattr__ = lazy_facade(__name__, _HOMES)"


@pytest.fixture
def package(tmp_path, monkeypatch):
  """A package `shop` on sys.path: a facade over `shop.fruit` and `shop.tools`, and `shop.notes`,
  a module no home lists; removed from sys.modules afterwards."""
  folder = tmp_path / "shop"
  folder.mkdir()
  (folder / "__init__.py").write_text(
      "from lazy_facade import lazy_facade\n\n"
      "_HOMES = ((\"shop.fruit\", (\"pear\", \"APPLE\")), (\"shop.tools\", (\"saw\",)))\n\n"
      f"{FACADE_LINE}\n")
  (folder / "fruit.py").write_text("APPLE = 'apple'\n\n\ndef pear():\n  return 'pear'\n")
  (folder / "tools.py").write_text("saw = 'saw'\n")
  (folder / "notes.py").write_text("TEXT = 'notes'\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  yield importlib.import_module("shop")
  for name in [m for m in sys.modules if m == "shop" or m.startswith("shop.")]:
    del sys.modules[name]


def test_all_is_every_name_sorted(package):
  assert package.__all__ == ["APPLE", "pear", "saw"]


def test_a_home_is_imported_on_first_use_only(package):
  assert "shop.fruit" not in sys.modules and "shop.tools" not in sys.modules
  assert package.APPLE == "apple" and package.pear() == "pear"
  assert "shop.fruit" in sys.modules and "shop.tools" not in sys.modules
  from shop import saw
  assert saw == "saw"


def test_a_submodule_no_home_lists_still_imports(package):
  from shop import notes
  assert notes.TEXT == "notes"


def test_an_unknown_name_is_an_attribute_error(package):
  with pytest.raises(AttributeError, match="module 'shop' has no attribute 'plum'"):
    getattr(package, "plum")


def test_a_name_under_two_homes_is_refused():
  with pytest.raises(ValueError, match="shop: 'saw' is listed under both shop.tools and shop.garden"):
    lazy_facade("shop", (("shop.tools", ("saw",)), ("shop.garden", ("rake", "saw"))))


def test_a_name_that_is_its_home_module_is_refused():
  """Importing `shop.saw` sets the package's attribute `saw` to the module, hiding the function."""
  with pytest.raises(ValueError, match="shop: 'saw' is named as its home module"):
    lazy_facade("shop", (("shop.saw", ("saw", "SAW_TEETH")),))


def _product_facades() -> list[str]:
  """Every product package whose `__init__` is a facade (it has the facade line)."""
  found = []
  for top in ("attention", "producers", "pipelines"):
    for path in sorted((ROOT / top).rglob("__init__.py")):
      if FACADE_LINE in path.read_text():
        found.append(".".join(path.parent.relative_to(ROOT).parts))
  return found


def test_the_product_facades_are_found():
  facades = _product_facades()
  assert {"attention", "producers", "pipelines", "pipelines.pipeline", "pipelines.wan.vae"} <= set(facades), facades
  assert len(facades) == 13, facades


def test_no_product_facade_name_is_a_module_of_its_package():
  """A module `name.py` (or package `name/`) beside a facade's `__init__` would replace the facade's
  `name` once imported."""
  clashes = []
  for name in _product_facades():
    folder = ROOT.joinpath(*name.split("."))
    clashes += [f"{name}.{n}" for n in importlib.import_module(name).__all__
                if (folder / f"{n}.py").exists() or (folder / n / "__init__.py").exists()]
  assert not clashes, clashes


@pytest.mark.parametrize("name", _product_facades())
def test_every_name_of_a_product_facade_resolves(name):
  facade = importlib.import_module(name)
  missing = [n for n in facade.__all__ if not hasattr(facade, n)]
  assert not missing, f"{name}: names no home defines: {missing}"
