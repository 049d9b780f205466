"""What a command does first, before its heavy imports: flax imported without IPython.

flax.nnx (`flax/nnx/reprlib.py`, flax 0.12) decides at import whether its reprs are coloured and,
for that, imports IPython to call `get_ipython()`. Where IPython is installed (Colab and Kaggle
images, TPU VMs) that import alone took 1.6 s of the tiny default's warm `generate` on a TPU v5e
host under cProfile (2026-12-08; its load stage 2.5 -> 1.2 s without the profiler, of a ~6-s run),
for an answer known in advance: in a process that has not imported IPython no IPython shell runs,
so `get_ipython()` is None. One lasting effect: treescope, imported in that window, keeps
"no IPython" for the process (its notebook display hooks), which a command never uses.
"""

from __future__ import annotations

import importlib
import sys


def import_flax_without_ipython() -> None:
  """Imports `flax.nnx` with IPython hidden (`sys.modules["IPython"] = None`, so that its import
  raises ImportError, which flax takes as "no IPython shell") when IPython is not imported yet, then
  unhides it; the same colours and behaviour, without the import. With IPython already imported
  (a notebook), or flax.nnx already imported, it only imports flax.nnx (a no-op for the latter).

  Raises:
    ImportError: flax is not installed.
  """
  if "IPython" in sys.modules or "flax.nnx" in sys.modules:
    importlib.import_module("flax.nnx")
    return
  sys.modules["IPython"] = None  # type: ignore[assignment]  (Python's documented import blocker)
  try:
    importlib.import_module("flax.nnx")
  finally:
    if "IPython" in sys.modules and sys.modules["IPython"] is None:
      del sys.modules["IPython"]
