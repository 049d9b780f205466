"""The Wan model, as components: on the ground floor `transformer`, `vae`, `encoders` and
`schedulers`, which import no other component; above them `conditioning`, `step_cache`, `lora` and
`pretrained`, which import only the ground floor (tests/test_architecture.py checks both).

Each component's `__init__` is a lazy facade: a `_HOMES` table of (module, names) and a module
`__getattr__` made by `lazy_attributes`, so that importing a component imports none of its modules.
"""

import importlib
from collections.abc import Callable, Sequence


def lazy_attributes(package: str, homes: Sequence[tuple[str, Sequence[str]]]) -> Callable[[str], object]:
  """A module `__getattr__` (PEP 562) for `package` that imports each name's home module on first use.

  Raises (from the returned function):
    AttributeError: a name no home lists (so `from package import submodule` still finds a submodule).
  """

  def __getattr__(name: str):
    for module, names in homes:
      if name in names:
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")

  return __getattr__
