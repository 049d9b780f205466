"""Multi-process (multi-host) runs on JAX's distributed runtime: start, place, gather, stop.

One process per host (or, for tests, several on one machine), all started with the same arguments
and a distinct process id. `initialize` connects them through the coordinator (process 0 hosts
it); afterwards `jax.devices()` lists every process's devices, so the (ring, ulysses) mesh spans
hosts (ring outer, DESIGN.md section 2). Every process computes the same host values (prompts are
encoded and noise is drawn from the seed on each), and `put_replicated` turns them into global
arrays with `jax.make_array_from_callback`; nothing is broadcast. `to_host` reads a result back on
every process; only process 0 writes files (`is_main_process`).

Settings come from flags or, when a flag is not given, from the environment:
  JAX_COORDINATOR_ADDRESS  HOST:PORT of process 0's coordinator (jax.distributed reads it too)
  JAX_NUM_PROCESSES        number of processes   (read here; jax 0.10 itself does not)
  JAX_PROCESS_ID           this process's id, 0 .. N-1   (read here; jax 0.10 itself does not)
All three are passed to `jax.distributed.initialize` explicitly, with cluster auto-detection
(Slurm, Open MPI, TPU, Kubernetes) off: what was given is what runs. On CPU, cross-process
collectives use gloo (`jax_cpu_collectives_implementation`), which is what makes a multi-process
run testable on one machine.

Faults: a process that cannot reach the coordinator, or a coordinator whose peers do not all
connect, fails after the timeout with a message saying so (`initialize`). A process that dies
mid-run is detected by JAX's coordination service when its heartbeats stop for
`ProcessSpec.heartbeat_timeout_s` (default 30 s; JAX's own default is 100 s); JAX then aborts every
surviving process from C++ (SIGABRT and a stack dump, not a Python exception). `generate` runs each
process under `pipelines.parallel.supervisor`, which turns that into one line naming the lost process and
exit status 3, with the low-level log in a file.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
DEFAULT_TIMEOUT_S = 120
DEFAULT_HEARTBEAT_TIMEOUT_S = 30


class DistributedError(RuntimeError):
  """The distributed runtime could not start (coordinator unreachable, started too late, ...)."""


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
  """Where this process sits in a multi-process run.

  Attributes:
    coordinator: "HOST:PORT" of process 0's coordinator service.
    num_processes: N >= 1.
    process_id: 0 .. N - 1; process 0 hosts the coordinator and writes the outputs.
    timeout_s: how long to wait for the coordinator and every process to connect (and, at the
      end, for every process to reach shutdown).
    heartbeat_timeout_s: a process whose heartbeats stop for this long counts as dead and the run
      is stopped on every process (JAX's `heartbeat_timeout_seconds`).
  """
  coordinator: str
  num_processes: int
  process_id: int
  timeout_s: int = DEFAULT_TIMEOUT_S
  heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S

  def __post_init__(self):
    if re.fullmatch(r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})", self.coordinator) is None:
      raise ValueError(f"coordinator={self.coordinator!r} must be HOST:PORT, e.g. 10.0.0.1:1234 "
                       "(process 0's address and a free port, the same on every process)")
    port = int(self.coordinator.rsplit(":", 1)[1])
    if not 0 < port < 65536:
      raise ValueError(f"coordinator={self.coordinator!r}: port {port} must be in 1..65535")
    if self.num_processes < 1:
      raise ValueError(f"num_processes={self.num_processes} must be >= 1")
    if not 0 <= self.process_id < self.num_processes:
      raise ValueError(f"process_id={self.process_id} must be in 0..{self.num_processes - 1} "
                       f"(num_processes={self.num_processes})")
    if self.timeout_s < 1:
      raise ValueError(f"timeout_s={self.timeout_s} must be >= 1 second")
    if self.heartbeat_timeout_s < 2:
      raise ValueError(f"heartbeat_timeout_s={self.heartbeat_timeout_s} must be >= 2 seconds (JAX sends "
                       "a heartbeat about every second)")


def _env_int(env: Mapping[str, str], name: str) -> int | None:
  text = env.get(name)
  if text is None or text == "":
    return None
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"environment variable {name}={text!r} must be an integer") from None


def process_spec(coordinator: str | None = None, num_processes: int | None = None,
                 process_id: int | None = None, *, timeout_s: int = DEFAULT_TIMEOUT_S,
                 heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
                 env: Mapping[str, str] | None = None) -> ProcessSpec | None:
  """The multi-process settings from arguments, each falling back to its environment variable.

  Returns:
    None for a single-process run (none of the three given anywhere, or one process without a
    coordinator), else a checked `ProcessSpec`.

  Raises:
    ValueError: only some of the three given, or a bad value (naming the flag and variable).
  """
  env = os.environ if env is None else env
  coordinator = coordinator if coordinator is not None else (env.get(ENV_COORDINATOR) or None)
  num_processes = num_processes if num_processes is not None else _env_int(env, ENV_NUM_PROCESSES)
  process_id = process_id if process_id is not None else _env_int(env, ENV_PROCESS_ID)
  given = {"--coordinator / " + ENV_COORDINATOR: coordinator,
           "--num-processes / " + ENV_NUM_PROCESSES: num_processes,
           "--process-id / " + ENV_PROCESS_ID: process_id}
  if all(v is None for v in given.values()):
    return None
  if coordinator is None and num_processes == 1 and process_id in (None, 0):
    return None
  missing = [name for name, v in given.items() if v is None]
  if missing:
    raise ValueError(f"a multi-process run needs all of coordinator, num_processes and process_id; "
                     f"missing {missing} (given: {coordinator=}, {num_processes=}, {process_id=})")
  return ProcessSpec(coordinator, num_processes, process_id, timeout_s, heartbeat_timeout_s)


def _unreachable_message(spec: ProcessSpec, what: str) -> str:
  return (f"process {spec.process_id} of {spec.num_processes}: {what} within {spec.timeout_s} s; "
          f"start every process with the same --coordinator (process 0's address and a free port; "
          f"here {spec.coordinator}) and --num-processes {spec.num_processes}, distinct --process-id "
          f"0..{spec.num_processes - 1}, or raise --coordinator-timeout")


def _wait_for_coordinator(spec: ProcessSpec, deadline: float) -> None:
  """Polls process 0's coordinator port with plain TCP connects until it answers or `deadline`.

  Raises:
    DistributedError: the port never accepted a connection.
  """
  host, port = spec.coordinator.rsplit(":", 1)
  host = host.strip("[]")
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=1.0):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise DistributedError(_unreachable_message(
            spec, f"could not reach the coordinator at {spec.coordinator} ({e})")) from e
      time.sleep(0.2)


def _give_up(spec: ProcessSpec) -> None:
  """Watchdog: JAX's runtime aborts the process (no Python exception) when the connect deadline
  passes, so this says why first and exits with status 1."""
  print(f"error: {_unreachable_message(spec, 'not every process connected to the coordinator')}",
        file=sys.stderr, flush=True)
  os._exit(1)


def _heartbeat_kwargs(spec: ProcessSpec) -> dict[str, int]:
  """`heartbeat_timeout_seconds` for this JAX's `jax.distributed.initialize` (an older JAX without
  the argument keeps its own 100 s)."""
  import inspect

  import jax
  if "heartbeat_timeout_seconds" in inspect.signature(jax.distributed.initialize).parameters:
    return {"heartbeat_timeout_seconds": spec.heartbeat_timeout_s}
  return {}


def initialize(spec: ProcessSpec) -> None:
  """Joins the run: `jax.distributed.initialize` with gloo CPU collectives, before JAX's backend.

  Processes other than 0 first wait (up to `spec.timeout_s`) for the coordinator's port to accept
  connections, which turns a wrong address or a missing process 0 into a `DistributedError`. JAX's
  own connect then waits for all processes; it aborts the process without a Python exception when
  its deadline passes, so a watchdog thread prints the reason and exits with status 1 just before
  that (the only way to fail cleanly there; nothing has been computed or written at that point).

  Raises:
    DistributedError: JAX's backend already started in this process, or the coordinator was not
      reachable within `spec.timeout_s`.
  """
  import jax

  deadline = time.monotonic() + spec.timeout_s
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if spec.process_id != 0:
    _wait_for_coordinator(spec, deadline)
  watchdog = threading.Timer(max(deadline - time.monotonic(), 0.1), _give_up, args=(spec,))
  watchdog.daemon = True
  watchdog.start()
  try:
    # JAX's deadline is later than the watchdog's, so the watchdog reports first.
    jax.distributed.initialize(coordinator_address=spec.coordinator, num_processes=spec.num_processes,
                               process_id=spec.process_id, cluster_detection_method="deactivate",
                               initialization_timeout=spec.timeout_s + 30,
                               shutdown_timeout_seconds=spec.timeout_s, **_heartbeat_kwargs(spec))
  except RuntimeError as e:
    if not jax.distributed.is_initialized() and "before any JAX calls" in str(e):
      raise DistributedError("the distributed runtime must start before JAX's backend; call "
                             "pipelines.parallel.distributed.initialize (or pass --coordinator to generate) "
                             "before any jax.devices() or computation") from e
    raise DistributedError(_unreachable_message(spec, f"joining the run failed ({e})")) from e
  finally:
    watchdog.cancel()


def shutdown() -> None:
  """Leaves the run (a barrier with the other processes, bounded by the spec's timeout); no-op
  when the runtime is not started (or JAX was never imported: nothing ran)."""
  if "jax" not in sys.modules:
    return
  import jax
  if jax.distributed.is_initialized():
    jax.distributed.shutdown()


def is_main_process() -> bool:
  """True on process 0 (and in a single-process run): the one that writes outputs."""
  import jax
  return jax.process_index() == 0


def put_replicated(tree: Any, sharding: Any) -> Any:
  """Places a pytree of host values (numpy or single-process jax arrays) with `sharding` (one for
  every leaf; see `put_sharded`)."""
  import jax
  return put_sharded(tree, jax.tree.map(lambda _: sharding, tree))


def put_sharded(tree: Any, shardings: Any) -> Any:
  """Places each leaf of a pytree with its sharding (`shardings`: the same structure).

  Single process: `jax.device_put` (which also moves arrays already on devices). Multi-process:
  each leaf is read to the host and assembled with `jax.make_array_from_callback`, every process
  filling its own devices' parts from its own (identical) copy, so no data crosses hosts.
  """
  import jax
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)

  def one(leaf, sharding):
    host = to_host(leaf)  # a global array (e.g. one computed on the mesh) is read back first
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  return jax.tree.map(one, tree, shardings)


PROGRESS_BYTES = 2 << 30  # `put_host_leaves` shows a progress bar from this many bytes on (progress=None)


def put_host_leaves(tree: Any, shardings: Any, *, progress: bool | None = None,
                    desc: str = "loading weights") -> Any:
  """Places a tree of `weights.HostLeaf`s (memory-mapped checkpoint views) on devices.

  Each leaf becomes a global array with its sharding through `jax.make_array_from_callback`:
  every device's part is read from the mapped file and converted (transpose, dtype) in one copy,
  so a sharded weight is never assembled whole on the host, and every process of a multi-process
  run reads only its own devices' parts (no data crosses hosts). A replicated leaf is read once
  per process (the last part is reused for the next device asking for the same index). Leaves
  are placed by up to 4 threads (numpy copies release the GIL), with at most the largest leaf's
  bytes of host copies in flight: host memory beyond the placed arrays stays within one tensor.

  Args:
    tree: pytree whose leaves are `weights.HostLeaf`.
    shardings: the same structure, a `jax.sharding.Sharding` per leaf; or None: the default
      device, uncommitted (as `jnp.asarray` places: a later jit may move them to its devices).
    progress: a tqdm bar over bytes on the main process; None: only from `PROGRESS_BYTES` on.
    desc: the bar's label.

  Returns:
    The same structure with `jax.Array` leaves.
  """
  import concurrent.futures

  import jax

  from pipelines.storage.weights import HostLeaf

  leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, HostLeaf))
  sharding_leaves = [None] * len(leaves) if shardings is None else treedef.flatten_up_to(shardings)
  total = sum(leaf.nbytes for leaf in leaves)
  show = (total >= PROGRESS_BYTES if progress is None else progress) and is_main_process()
  bar = None
  if show:
    from tqdm import tqdm
    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)
  # Host copies in flight at once: at most one leaf's worth (or one leaf when it is larger).
  placer = _BoundedPlacer(max((leaf.nbytes for leaf in leaves), default=0), bar)
  workers = max(1, min(4, os.cpu_count() or 1))
  try:
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      arrays = list(pool.map(placer.place, leaves, sharding_leaves))
  finally:
    if bar is not None:
      bar.close()
  return jax.tree.unflatten(treedef, arrays)


class _BoundedPlacer:
  """Places `HostLeaf`s from several threads with at most `budget` bytes of host copies in flight
  (one leaf larger than the budget goes alone); one per `put_host_leaves` call."""

  def __init__(self, budget: int, bar: Any = None):
    self.budget = budget
    self.bar = bar
    self.gate = threading.Condition()
    self.in_flight = 0

  def place(self, leaf: Any, sharding: Any) -> Any:
    """One leaf as a `jax.Array` with `sharding` (None: the default device, uncommitted)."""
    import jax

    with self.gate:
      self.gate.wait_for(lambda: self.in_flight == 0 or self.in_flight + leaf.nbytes <= self.budget)
      self.in_flight += leaf.nbytes
    try:
      if sharding is None:
        array = jax.device_put(leaf.read())
      else:
        array = jax.make_array_from_callback(leaf.shape, sharding, _last_part_reader(leaf))
      array.block_until_ready()  # the host copy is no longer needed
    finally:
      with self.gate:
        self.in_flight -= leaf.nbytes
        self.gate.notify_all()
    if self.bar is not None:
      self.bar.update(leaf.nbytes)
    return array


def _last_part_reader(leaf: Any) -> Any:
  """index -> leaf.read(index), reusing the last part read when the next device asks for the same
  index (a replicated leaf is read once per process)."""
  last: list[Any] = [None, None]

  def part(index):
    key = tuple((s.start, s.stop, s.step) for s in index)
    if last[0] != key:
      last[0], last[1] = key, leaf.read(index)
    return last[1]

  return part


def to_host(x: Any) -> np.ndarray:
  """A jax array as numpy on every process: a replicated global array is read from a local shard
  (no communication); a sharded one is all-gathered across processes."""
  import jax
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  check_equal_device_counts()  # before multihost_utils, which needs them equal
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def check_same_settings(settings: Mapping[str, Any], *, what: str = "were started with other settings",
                        fix: str = "start every process with the same command (only --process-id differs)") -> None:
  """In a multi-process run: every process was started with the same settings (a JSON-able dict,
  e.g. the parsed command without the process id). Processes given different seeds or prompts
  would otherwise run one computation with different inputs and write a video nobody asked for.

  Collective: every process must call it at the same point.

  Args:
    settings: what must agree; what: how the message says they differ; fix: what to do.

  Raises:
    ValueError: on every process when any differs, naming the processes and (on those) each
      setting that differs from process 0's.
  """
  import hashlib
  import json

  import jax
  if jax.process_count() == 1:
    return
  check_equal_device_counts()  # before multihost_utils, which needs them equal
  from jax.experimental import multihost_utils

  text = json.dumps(dict(settings), sort_keys=True, default=str).encode()
  digest = np.frombuffer(hashlib.sha256(text).digest(), np.uint8)
  digests = np.asarray(multihost_utils.process_allgather(digest)).reshape(jax.process_count(), -1)
  differ = [i for i in range(len(digests)) if not np.array_equal(digests[i], digests[0])]
  if not differ:
    return
  size = 1 << 16
  buf = np.zeros(size, np.uint8)
  buf[:min(len(text), size)] = np.frombuffer(text[:size], np.uint8)
  first = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).rstrip(b"\0")
  try:
    theirs = json.loads(first)
  except ValueError:
    theirs = {}
  mine = json.loads(text)
  details = [f"{k}: {mine.get(k)!r} here, {theirs.get(k)!r} on process 0" for k in sorted(set(mine) | set(theirs))
             if mine.get(k) != theirs.get(k)]
  raise ValueError(f"process(es) {differ} of {len(digests)} {what} than process 0"
                   + (f" ({'; '.join(details)})" if details else "") + f"; {fix}")


def process_device_counts(devices: Sequence[Any] | None = None) -> list[int]:
  """Devices per process: entry i counts the devices (default `jax.devices()`, every process's)
  whose `process_index` is i, for i < `jax.process_count()`. Reads no data from other processes."""
  import jax
  devices = jax.devices() if devices is None else devices
  counts = collections.Counter(int(d.process_index) for d in devices)
  return [counts.get(i, 0) for i in range(jax.process_count())]


def check_equal_device_counts(devices: Sequence[Any] | None = None) -> None:
  """Every process of a multi-process run must hold the same number of devices: JAX's host
  collectives (`jax.experimental.multihost_utils`, used by `check_same_settings`, `to_host`, the
  seed broadcast) lay `jax.devices()` out as [processes, local devices], and the meshes here put
  Ulysses within a host and the ring across hosts. Call before any of them (otherwise numpy's
  "cannot reshape array of size 6 into shape (2,4)" is all one gets).

  Raises:
    ValueError: unequal counts, naming each process's and the fix.
  """
  counts = process_device_counts(devices)
  if len(set(counts)) <= 1:
    return
  each = ", ".join(f"process {i}: {c}" for i, c in enumerate(counts))
  raise ValueError(
      f"the {len(counts)} processes see unequal device counts ({each}; {sum(counts)} in all); a "
      "multi-process run needs the same number on every process: make each one see "
      f"{min(counts)} device(s) (e.g. CUDA_VISIBLE_DEVICES, TPU_VISIBLE_CHIPS, or "
      "--xla_force_host_platform_device_count on CPU), or use hosts with equal accelerators")


def check_mesh_spans_processes(mesh_devices: int | None) -> None:
  """In a multi-process run every process must hold as many devices as the others
  (`check_equal_device_counts`) and the mesh must hold every process's devices (a process with no
  device in the mesh would have no part of the computation).

  Raises:
    ValueError: unequal device counts across processes (each named); no mesh, or a mesh smaller
      than `jax.device_count()`.
  """
  import jax
  if jax.process_count() == 1:
    return
  check_equal_device_counts()
  total = jax.device_count()
  if mesh_devices != total:
    raise ValueError(
        f"a {jax.process_count()}-process run needs a mesh over all {total} devices "
        f"({jax.local_device_count()} per process), got {mesh_devices or 1}; pass a mesh with "
        f"U*R = {total}, e.g. U={jax.local_device_count()},R={jax.process_count()} (Ulysses within a "
        "host, ring across hosts)")
