"""The one form of a package's facade (PEP 562): its `__init__` lists where each public name lives,
and a name's home module is imported the first time the name is asked for. Importing a package
therefore imports none of its modules, and a JAX-free module behind a facade loads without JAX.

  _HOMES = (
      ("attention.mesh", ("MeshSpec", "make_mesh")),
      ("attention.usp", ("usp_attention",)),
  )

  __all__, __getattr__ = lazy_facade(__name__, _HOMES)

Imports only the standard library, so that every layer may import it (the lowest rank in
tests/test_architecture.py's LAYERS).
"""

import importlib
from collections.abc import Callable, Sequence

Homes = Sequence[tuple[str, Sequence[str]]]


def lazy_facade(package: str, homes: Homes) -> tuple[list[str], Callable[[str], object]]:
  """A package's `__all__` (its names, sorted) and its module `__getattr__`.

  Args:
    package: the package's `__name__` (for the error messages).
    homes: (home module's dotted name, the public names it defines) pairs; a home may itself be a
      facade (another package's `__init__`).

  Returns:
    (`__all__`, `__getattr__`): the returned `__getattr__` imports a name's home on first use and
    returns the home's attribute; for a name no home lists it raises AttributeError, so that
    `from package import submodule` still finds a submodule.

  Raises:
    ValueError: a name listed under two homes (a name has one address), or a name that is its home's
      own name (`package.name` would be the module once the module is imported).
  """
  home_of: dict[str, str] = {}
  for module, names in homes:
    for name in names:
      if name in home_of:
        raise ValueError(f"{package}: {name!r} is listed under both {home_of[name]} and {module}")
      if module == f"{package}.{name}":
        raise ValueError(f"{package}: {name!r} is named as its home module, which replaces it in the package "
                         "once imported; rename the module")
      home_of[name] = module

  def __getattr__(name: str) -> object:
    if name not in home_of:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home_of[name]), name)

  return sorted(home_of), __getattr__
