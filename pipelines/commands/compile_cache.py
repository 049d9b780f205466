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
import threading
from typing import Any

ENV = "WAN_USP_JAX_COMPILE_CACHE"
OFF_VALUES = ("", "off", "0", "none", "false", "no")
# Programs that compile faster than this are not written. JAX's default, 1 s, skips most programs
# of the tiny model; with 0 the README run writes 29 programs (~0.4 MB) and the next run loads all
# of them (with 0.2 s: 6 written, the other 23 compiled again on every run).
MIN_COMPILE_TIME_S = 0.0
# JAX's monitoring events. "cache_misses" is recorded when JAX hands a compiled program to the
# cache (jax/_src/compilation_cache.py `put_executable_and_time`), before the write: the write can
# still not happen (an entry larger than `jax_compilation_cache_max_size`, an eviction that fails
# on an entry without its "-atime" file, a read-only directory: JAX only warns), so "written" is
# counted in the directory instead (`CacheUse.written`).
_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "lookups",
           "/jax/compilation_cache/cache_hits": "hits",
           "/jax/compilation_cache/cache_misses": "misses"}


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


def _entry_names(path: str) -> frozenset[str]:
  """The executables' files in a JAX cache directory (its LRU cache keeps one `<key>-cache` file
  each); empty when the directory cannot be read."""
  try:
    return frozenset(name for name in os.listdir(path) if name.endswith("-cache"))
  except OSError:
    return frozenset()


def _entries(path: str) -> int:
  """Executables in a JAX cache directory."""
  return len(_entry_names(path))


@dataclasses.dataclass
class CacheUse:
  """What the cache did during a run, counted from `enable` on.

  Attributes:
    path: the cache directory, None when off.
    lookups: compilations that consulted the cache (JAX's monitoring event).
    hits: executables loaded from the cache instead of compiled (JAX's event).
    misses: executables compiled and handed to the cache for writing (JAX's "cache_misses" event,
      recorded before the write, which can still fail or be refused: see `_EVENTS`).
    entries_before: executables in the directory when the run started.
    names_before: their file names (what `written` compares with).
    stages: the same counts per stage of the run ({stage: {lookups, hits, misses}}): "load" from
      `enable` on, then each name `mark` is given (`CallOptions.on_stage`) in the thread that
      marks it (the decoder's compile-ahead thread marks "decode_compile_ahead" beside the others);
      a thread that never marked counts for the stage of the thread that made this `CacheUse`.
  """
  path: str | None
  lookups: int = 0
  hits: int = 0
  misses: int = 0
  entries_before: int = 0
  names_before: frozenset[str] = dataclasses.field(default_factory=frozenset, repr=False)
  stages: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
  _stage: str = dataclasses.field(default="load", repr=False)  # the making thread's stage
  _owner: int = dataclasses.field(default_factory=threading.get_ident, repr=False, compare=False)
  _marked: threading.local = dataclasses.field(default_factory=threading.local, repr=False, compare=False)
  _lock: Any = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)
  _listening: bool = dataclasses.field(default=False, repr=False)

  def _count(self, event: str, **kwargs: Any) -> None:
    del kwargs
    field = _EVENTS.get(event)
    if field is None:
      return
    name = getattr(self._marked, "stage", self._stage)
    with self._lock:  # compiles in two threads (the decoder's ahead of time)
      setattr(self, field, getattr(self, field) + 1)
      stage = self.stages.setdefault(name, dict.fromkeys(_EVENTS.values(), 0))
      stage[field] += 1

  def mark(self, stage: str) -> None:
    """The events of the calling thread from now on belong to `stage` (until its next mark)."""
    if threading.get_ident() == self._owner:
      self._stage = stage
    else:
      self._marked.stage = stage

  @property
  def written(self) -> int:
    """Executables written by this run: entries in the directory now that were not there at
    `enable` (lists the directory). An entry written and evicted again within the run is not
    counted (it is not there to load); another process writing to the same directory at the same
    time is (JAX's cache is shared that way)."""
    if self.path is None:
      return 0
    return len(_entry_names(self.path) - self.names_before)

  def report(self) -> dict[str, Any]:
    """For the sidecar: the directory, the counts, and `hit`: some executable came from the cache."""
    if self.path is None:
      return {"dir": None, "hit": False}
    return {"dir": self.path, "hit": self.hits > 0, "lookups": self.lookups, "hits": self.hits,
            "compiled_for_cache": self.misses, "written": self.written,
            "entries_before": self.entries_before, "entries_after": _entries(self.path),
            "stages": {name: {"lookups": c["lookups"], "hits": c["hits"], "compiled_for_cache": c["misses"]}
                       for name, c in self.stages.items()}}

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
      stages = ", ".join(f"{name} {c['hits']}/{c['lookups']}" for name, c in self.stages.items() if c["lookups"])
      return f"compile cache hit ({self.hits} of {self.lookups} programs loaded: {stages})"
    written = self.written
    unstored = max(self.misses - written, 0)
    text = f"compile cache filled ({written} programs written)" if written else "compile cache: nothing written"
    if unstored:
      text += (f"; {unstored} compiled programs were not stored (see JAX's warnings: a full cache "
               "under jax_compilation_cache_max_size, or a directory it cannot write)")
    return text


def enable(path: str | None) -> CacheUse:
  """Points JAX's persistent compilation cache at `path` (None: leaves it off) and starts counting
  its use. Call before the first compilation of the process: JAX decides once whether it uses the
  cache."""
  use = CacheUse(path)
  if path is None:
    return use
  import jax

  use.names_before = _entry_names(path)
  use.entries_before = len(use.names_before)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
  jax.monitoring.register_event_listener(use._count)
  use._listening = True
  return use
