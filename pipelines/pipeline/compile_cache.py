"""JAX's persistent compilation cache for the `generate` command.

Every run compiles the text encoder, the denoise step and the VAE decoder; with this cache a
second run of the same shapes (same model architecture, size, frames, text length, mesh, dtype,
JAX version and backend) loads the executables from disk instead.

Where (first that applies):
  1. `generate --no-compile-cache`: off;
  2. `generate --compile-cache DIR`: DIR;
  3. the environment variable WAN_USP_JAX_COMPILE_CACHE: a directory, or empty / "off" / "0" /
     "none" / "false" / "no" for off;
  4. JAX's own JAX_COMPILATION_CACHE_DIR, when set;
  5. $XDG_CACHE_HOME/wan-usp-jax/jax, or ~/.cache/wan-usp-jax/jax without XDG_CACHE_HOME.

JAX's own warning applies: the cache is trusted code; do not point it at a directory that others
can write to.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

ENV = "WAN_USP_JAX_COMPILE_CACHE"
OFF_VALUES = ("", "off", "0", "none", "false", "no")
# Programs that compile faster than this are not written. JAX's default, 1 s, skips most programs
# of the tiny model; with 0 the README run writes 29 programs (~0.4 MB) and the next run loads all
# of them (with 0.2 s: 6 written, the other 23 compiled again on every run).
MIN_COMPILE_TIME_S = 0.0
_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "lookups",
           "/jax/compilation_cache/cache_hits": "hits",
           "/jax/compilation_cache/cache_misses": "written"}


def default_dir() -> str:
  """$XDG_CACHE_HOME/wan-usp-jax/jax, or ~/.cache/wan-usp-jax/jax."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "wan-usp-jax", "jax")


def resolve_dir(flag: str | None, disabled: bool) -> str | None:
  """The cache directory from the flags and the environment (module docstring), None when off."""
  if disabled:
    return None
  if flag is not None:
    return os.path.abspath(os.path.expanduser(flag))
  if ENV in os.environ:
    value = os.environ[ENV].strip()
    return None if value.lower() in OFF_VALUES else os.path.abspath(os.path.expanduser(value))
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  return default_dir()


def _entries(path: str) -> int:
  """Executables in a JAX cache directory (its LRU cache keeps one `<key>-cache` file each)."""
  try:
    return sum(name.endswith("-cache") for name in os.listdir(path))
  except OSError:
    return 0


@dataclasses.dataclass
class CacheUse:
  """What the cache did during a run: JAX's monitoring events, counted from `enable` on.

  Attributes:
    path: the cache directory, None when off.
    lookups: compilations that consulted the cache.
    hits: executables loaded from the cache instead of compiled.
    written: executables compiled and written to the cache.
    entries_before: executables in the directory when the run started.
  """
  path: str | None
  lookups: int = 0
  hits: int = 0
  written: int = 0
  entries_before: int = 0
  _listening: bool = dataclasses.field(default=False, repr=False)

  def _count(self, event: str, **kwargs: Any) -> None:
    del kwargs
    field = _EVENTS.get(event)
    if field is not None:
      setattr(self, field, getattr(self, field) + 1)

  def report(self) -> dict[str, Any]:
    """For the sidecar: the directory, the counts, and `hit`: some executable came from the cache."""
    if self.path is None:
      return {"dir": None, "hit": False}
    return {"dir": self.path, "hit": self.hits > 0, "lookups": self.lookups, "hits": self.hits,
            "written": self.written, "entries_before": self.entries_before,
            "entries_after": _entries(self.path)}

  def close(self) -> None:
    """Stops counting (the cache itself stays configured: JAX decides once per process)."""
    if self._listening:
      import jax
      jax.monitoring.unregister_event_listener(self._count)
      self._listening = False

  def summary(self) -> str:
    """A few words for the command's last line."""
    if self.path is None:
      return "compile cache off"
    if self.hits:
      return f"compile cache hit ({self.hits} of {self.lookups} programs loaded)"
    return f"compile cache filled ({self.written} programs written)"


def enable(path: str | None) -> CacheUse:
  """Points JAX's persistent compilation cache at `path` (None: leaves it off) and starts counting
  its use. Call before the first compilation of the process: JAX decides once whether it uses the
  cache."""
  use = CacheUse(path)
  if path is None:
    return use
  import jax

  use.entries_before = _entries(path)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
  jax.monitoring.register_event_listener(use._count)
  use._listening = True
  return use
