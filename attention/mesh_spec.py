"""The device mesh, owned in one place: `MeshSpec` parses, validates, builds and describes it.

This module imports no JAX (the command line parses and checks a mesh before JAX starts); JAX is
imported by `MeshSpec.check` without a device count and by `MeshSpec.build`. `attention.mesh` holds
the JAX side: the sequence `PartitionSpec`s and `make_mesh`.

DESIGN.md section 2. The mesh has three axes, outermost first (four with a windows split):
- "cfg" (C): classifier-free guidance parallelism; the cond and uncond halves of the batch run on
  the two halves of the devices (C = 1: no split);
- "windows" (W, only when W > 1): context windows of a long video run in parallel; each guidance
  half's rows are split again over W groups of R * U consecutive devices;
- "ring" (R): K/V rotation (may cross hosts);
- "ulysses" (U): the all-to-all over heads, innermost, so its all-to-all stays among neighbouring
  devices.
Tokens are sharded over ring and ulysses jointly, ring-major: device (c, r, u) holds token chunk
r * U + u of batch rows c * B/C ... (c + 1) * B/C - 1, i.e. `P(CFG_AXIS, (RING_AXIS, ULYSSES_AXIS))`
(`SEQUENCE_SPEC`; without a cfg split the batch axis is simply replicated over a size-1 axis). With
a windows axis the rows are split over (cfg, windows), cfg-major: device (c, w, r, u) holds token
chunk r * U + u of row chunk c * W + w, i.e. `P((CFG_AXIS, WINDOWS_AXIS), (RING_AXIS, ULYSSES_AXIS))`.
With W = 1 the mesh has no windows axis at all, so every W = 1 program is the three-axis one.

The spec string, used by every command and report: "U=2,R=2", "CFG=2,U=2,R=2", "CFG=2,W=2,U=2,R=1"
(any order, case of the names free, missing degrees are 1). `MeshSpec` is also the only place that
asks XLA for fake CPU devices (`request_cpu_devices`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Sequence

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  import jax
  from jax.sharding import Mesh

CFG_AXIS = "cfg"
WINDOWS_AXIS = "windows"
RING_AXIS = "ring"
ULYSSES_AXIS = "ulysses"
MESH_AXES = (CFG_AXIS, RING_AXIS, ULYSSES_AXIS)  # the axes of a mesh with W = 1
WINDOWS_MESH_AXES = (CFG_AXIS, WINDOWS_AXIS, RING_AXIS, ULYSSES_AXIS)  # ... and with W > 1
SEQUENCE_AXES = (RING_AXIS, ULYSSES_AXIS)
DEVICE_FLAG = "xla_force_host_platform_device_count"
_NAMES = {"U": "ulysses", "R": "ring", "CFG": "cfg", "W": "windows"}


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def heads_fit(ulysses: int, num_heads: int, num_kv_heads: int) -> bool:
  """Whether U splits the heads: N % U == 0 and (K % U == 0, or U % K == 0: each kv head repeated
  U/K times in grouped order)."""
  return num_heads % ulysses == 0 and (num_kv_heads % ulysses == 0 or ulysses % num_kv_heads == 0)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """A mesh as the user asks for it: degrees and whether the transformer weights are sharded.

  Attributes:
    ulysses: U >= 1, the Ulysses degree (all-to-all over heads; U must split the heads).
    ring: R >= 1, the ring degree (K/V rotation).
    cfg: C in {1, 2}, classifier-free guidance parallelism (2: cond and uncond on separate halves).
    shard_weights: shard the stacked transformer block weights over all C * W * R * U devices
      (FSDP / ZeRO-3 style: gathered one layer at a time inside the layer scan) instead of
      replicating them.
    windows: W >= 1, context windows run in parallel: each guidance half's batch rows split over
      W groups of R * U devices (the mesh gains a "windows" axis only when W > 1).

  Raises:
    ValueError: a degree that is not an int >= 1, or cfg > 2.
  """
  ulysses: int = 1
  ring: int = 1
  cfg: int = 1
  shard_weights: bool = False
  windows: int = 1

  def __post_init__(self):
    for name in ("ulysses", "ring", "cfg", "windows"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"mesh degree {name}={value!r} must be an integer >= 1")
      object.__setattr__(self, name, int(value))
    if self.cfg > 2:
      raise ValueError(f"CFG={self.cfg}: classifier-free guidance has two branches (cond, uncond); use "
                       "CFG=1 or CFG=2")
    if not isinstance(self.shard_weights, bool):
      raise ValueError(f"shard_weights={self.shard_weights!r} must be a bool")

  # --- the spec string ---

  @classmethod
  def parse(cls, spec: str, *, shard_weights: bool = False) -> MeshSpec:
    """"U=2,R=2" / "CFG=2,U=4" / "R=2,U=4,CFG=2" / "CFG=2,W=2,U=2,R=1" (any order, any case;
    missing degrees are 1) -> MeshSpec.

    Raises:
      ValueError: a malformed spec (for "AxB", naming the U=...,R=... it probably means), a
        repeated or unknown axis, a degree < 1, or "auto" (resolved by `end_to_end.plan`, not here).
    """
    text = str(spec).strip()
    if text.lower() == "auto":
      raise ValueError("mesh 'auto' is chosen by the planner (generate --mesh auto, end_to_end.plan) "
                       "for a model and device count; MeshSpec.parse takes explicit degrees")
    grid = re.fullmatch(r"(\d+)\s*[xX*]\s*(\d+)", text)
    if grid is not None:
      a, b = grid.groups()
      meant = f"'U={a},R={b}'" if a == b else f"'U={a},R={b}' or 'U={b},R={a}'"
      raise ValueError(f"mesh {spec=} does not say which degree is which; did you mean {meant}? Name "
                       "them: U is the Ulysses degree, R the ring degree, CFG the guidance split, W the "
                       "context windows run in parallel")
    degrees: dict[str, int] = {}
    for part in text.replace(" ", "").split(","):
      match = re.fullmatch(r"(U|R|CFG|W)=(\d+)", part, flags=re.IGNORECASE)
      if match is None:
        raise ValueError(f"mesh {spec=} is malformed at {part!r}; write e.g. 'U=2,R=2', 'R=2,U=4', 'U=4', "
                         "'CFG=2,U=2,R=2' or 'CFG=2,W=2,U=2,R=1' (U: Ulysses degree, R: ring degree, CFG: 1 "
                         "or 2, W: context windows run in parallel)")
      axis, value = match.group(1).upper(), int(match.group(2))
      if axis in degrees:
        raise ValueError(f"mesh {spec=} gives {axis} twice; give each of U, R, CFG and W at most once")
      if value < 1:
        raise ValueError(f"mesh {spec=}: {axis}={value} must be >= 1")
      degrees[axis] = value
    return cls(ulysses=degrees.get("U", 1), ring=degrees.get("R", 1), cfg=degrees.get("CFG", 1),
               shard_weights=shard_weights, windows=degrees.get("W", 1))

  def __str__(self) -> str:
    """The spec string: "U=2,R=2", with "CFG=2," and then "W=2," in front when the guidance or the
    windows are split ("CFG=2,W=2,U=2,R=1")."""
    text = f"U={self.ulysses},R={self.ring}"
    text = f"W={self.windows},{text}" if self.windows > 1 else text
    return f"CFG={self.cfg},{text}" if self.cfg > 1 else text

  def describe(self) -> dict[str, object]:
    """For logs and sidecars: {"spec", "CFG", "W", "U", "R", "devices", "shard_weights"}."""
    return {"spec": str(self), "CFG": self.cfg, "W": self.windows, "U": self.ulysses, "R": self.ring,
            "devices": self.devices, "shard_weights": self.shard_weights}

  @property
  def devices(self) -> int:
    """C * W * R * U."""
    return self.cfg * self.windows * self.ring * self.ulysses

  @property
  def sequence_devices(self) -> int:
    """R * U: the devices of one (guidance branch, windows group), which shard its tokens."""
    return self.ring * self.ulysses

  @property
  def row_groups(self) -> int:
    """C * W: the device groups the batch rows are split over (the batch must be a multiple)."""
    return self.cfg * self.windows

  @property
  def axes(self) -> tuple[str, ...]:
    """The built mesh's axis names: `MESH_AXES` when W = 1, `WINDOWS_MESH_AXES` when W > 1."""
    return WINDOWS_MESH_AXES if self.windows > 1 else MESH_AXES

  @property
  def shape(self) -> tuple[int, ...]:
    """The built mesh's shape, matching `axes`: (C, R, U), or (C, W, R, U) when W > 1."""
    if self.windows > 1:
      return (self.cfg, self.windows, self.ring, self.ulysses)
    return (self.cfg, self.ring, self.ulysses)

  # --- validation ---

  def too_few_devices(self, available: int, platform: str) -> str:
    """The message for a mesh of more devices than the `available` ones of `platform`, naming what
    runs here: on CPU, the same mesh on simulated devices (XLA's device-count flag, as `generate`
    sets it itself); on an accelerator, whose devices cannot be simulated, the planner's pick for
    the visible devices or no mesh (one device), or a mesh of at most `available` devices."""
    head = f"mesh {self} needs {self.devices} devices but {available} are visible"
    if platform == "cpu":
      return (f"{head}; use a smaller mesh (on CPU, set XLA_FLAGS=--{DEVICE_FLAG}={self.devices} before JAX "
              "starts)")
    devices = f"{available} visible {platform} device{'s' if available != 1 else ''}"
    smaller = f", or a mesh of at most {available} devices (e.g. U=1,R={available})" if available > 1 else ""
    return (f"{head}; what runs here: --mesh auto (the planner's pick for the {devices}; python -m "
            f"end_to_end.plan) or drop --mesh (mesh=None in Python: one device){smaller}")

  def workable(self, num_heads: int, num_kv_heads: int | None = None) -> list[MeshSpec]:
    """The specs with this one's device count, cfg, windows and weight sharding whose U splits the
    heads."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    return [dataclasses.replace(self, ulysses=u, ring=self.sequence_devices // u)
            for u in _divisors(self.sequence_devices) if heads_fit(u, num_heads, num_kv_heads)]

  def check(self, *, num_heads: int | None = None, num_kv_heads: int | None = None,
            device_count: int | None = None, cfg_active: bool | None = None, platform: str | None = None) -> None:
    """Checks the spec against the heads, the devices and the guidance, naming what would work.

    Args:
      num_heads, num_kv_heads: N and K of the model (K defaults to N); None skips the head check.
      device_count: devices available (None: `jax.device_count()`).
      cfg_active: whether the run uses classifier-free guidance (None: not known yet).
      platform: the devices' platform ("cpu", "tpu", "gpu"; None: `jax.default_backend()`, asked only
        when too few devices are visible), which decides what the device message proposes
        (`too_few_devices`).

    Raises:
      ValueError: more devices than available, heads that U does not split, or CFG=2 without
        guidance; each message names the workable choices.
    """
    if device_count is None:
      import jax  # noqa: PLC0415 (JAX starts only when the devices are asked for)
      device_count = jax.device_count()
    available = device_count
    if self.devices > available:
      if platform is None:
        import jax  # noqa: PLC0415
        platform = jax.default_backend()
      raise ValueError(self.too_few_devices(available, platform))
    if num_heads is not None:
      kv = num_heads if num_kv_heads is None else num_kv_heads
      if not heads_fit(self.ulysses, num_heads, kv):
        ok = ", ".join(str(s) for s in self.workable(num_heads, kv))
        why = (f"the model has {num_heads} heads, not divisible by the Ulysses degree U={self.ulysses}"
               if num_heads % self.ulysses else
               f"the model's kv heads K={kv} and U={self.ulysses} need K % U == 0 or U % K == 0")
        raise ValueError(f"{why}; with {self.devices} devices use one of: {ok}")
    if cfg_active is False and self.cfg > 1:
      raise ValueError(f"mesh {self} splits classifier-free guidance over CFG={self.cfg}, but guidance is "
                       f"off (guidance_scale <= 1); use {dataclasses.replace(self, cfg=1)} (or turn "
                       "guidance on)")

  # --- building ---

  def build(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The `jax.sharding.Mesh` of shape `shape`, axes `axes`, Auto axis types: (C, R, U) over
    `MESH_AXES` when W = 1 (exactly the three-axis mesh), (C, W, R, U) over `WINDOWS_MESH_AXES`
    when W > 1.

    Args:
      devices: at least C * W * R * U devices (default `jax.devices()`); the first C * W * R * U
        are laid out row-major, so consecutive devices share a Ulysses group, a windows group is
        R * U consecutive devices, and the two guidance halves are the first and second half
        (across hosts when each host holds half).

    Raises:
      ValueError: fewer devices than C * W * R * U.
    """
    import jax  # noqa: PLC0415 (building a mesh starts JAX; parsing and checking do not)
    from jax.sharding import Mesh  # noqa: PLC0415
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < self.devices:
      self.check(device_count=len(devices), platform=devices[0].platform if devices else None)
    grid = np.array(devices[: self.devices], dtype=object).reshape(self.shape)
    return Mesh(grid, self.axes, axis_types=(jax.sharding.AxisType.Auto,) * len(self.axes))

  @classmethod
  def of(cls, mesh: Mesh, *, shard_weights: bool = False) -> MeshSpec:
    """The spec of a built mesh (a mesh without a cfg axis has C = 1, without a windows axis W = 1).

    Raises:
      ValueError: a mesh without the ring and ulysses axes, or with other axes.
    """
    names = tuple(mesh.axis_names)
    if RING_AXIS not in names or ULYSSES_AXIS not in names or set(names) - set(WINDOWS_MESH_AXES):
      raise ValueError(f"mesh axes must be {MESH_AXES} or {WINDOWS_MESH_AXES} (cfg and windows optional), "
                       f"got {names}; build meshes with attention.MeshSpec(...).build() or attention.make_mesh")
    return cls(ulysses=int(mesh.shape[ULYSSES_AXIS]), ring=int(mesh.shape[RING_AXIS]),
               cfg=int(mesh.shape.get(CFG_AXIS, 1)), shard_weights=shard_weights,
               windows=int(mesh.shape.get(WINDOWS_AXIS, 1)))


def request_cpu_devices(count: int) -> int | None:
  """Asks XLA for `count` fake CPU devices (the only place that does): sets
  `--xla_force_host_platform_device_count` in XLA_FLAGS when JAX's backend has not started yet and
  the flags do not already set a count. Harmless on GPU/TPU (the flag only affects the CPU backend).

  Returns:
    the count set, or None when nothing was set (count <= 1, a count already in XLA_FLAGS, or the
    backend already started).
  """
  started = False
  if "jax" in sys.modules:  # whether XLA has read its flags already (private API: assume not where missing)
    try:
      from jax._src import xla_bridge  # noqa: PLC0415
      started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
      pass
  flags = os.environ.get("XLA_FLAGS", "")
  if count <= 1 or DEVICE_FLAG in flags or started:
    return None
  os.environ["XLA_FLAGS"] = f"{flags} --{DEVICE_FLAG}={count}".strip()
  return count
