"""Multi-process device checks (pipelines/parallel/distributed.py) with unequal device counts.

No processes are started: `jax.process_count`, `jax.devices` and friends are replaced by a fake
two-process view (devices are plain objects with a `process_index`, as JAX's are).
"""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils

from pipelines.parallel import distributed


def _fake_processes(monkeypatch, per_process: list[int], this: int = 0) -> list[types.SimpleNamespace]:
  """Makes JAX look like len(per_process) processes holding per_process[i] devices each."""
  devices = [types.SimpleNamespace(id=k, process_index=i, platform="cpu")
             for i, n in enumerate(per_process) for k in range(n)]
  monkeypatch.setattr(jax, "process_count", lambda: len(per_process))
  monkeypatch.setattr(jax, "process_index", lambda: this)
  monkeypatch.setattr(jax, "devices", lambda *a: list(devices))
  monkeypatch.setattr(jax, "device_count", lambda *a: len(devices))
  monkeypatch.setattr(jax, "local_device_count", lambda *a: per_process[this])

  def no_collective(*args, **kwargs):
    raise AssertionError("a host collective ran before the device counts were checked")
  monkeypatch.setattr(multihost_utils, "process_allgather", no_collective)
  monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", no_collective)
  return devices


def test_jax_host_layout_fails_obscurely_with_unequal_counts(monkeypatch):
  """Why the check exists: JAX's multihost_utils reshapes jax.devices() to [processes, local]."""
  devices = _fake_processes(monkeypatch, [4, 2])
  with pytest.raises(ValueError, match=r"cannot reshape array of size 6 into shape \(2,4\)"):
    np.array(devices).reshape(jax.process_count(), jax.local_device_count())


@pytest.mark.parametrize("mesh_devices", [6, 8, None])
def test_unequal_counts_named_per_process(monkeypatch, mesh_devices):
  _fake_processes(monkeypatch, [4, 2])
  with pytest.raises(ValueError, match=r"unequal device counts \(process 0: 4, process 1: 2; 6 in all\).*"
                                       r"make each one see 2 device\(s\)"):
    distributed.check_mesh_spans_processes(mesh_devices)


def test_unequal_counts_refused_before_settings_collective(monkeypatch):
  _fake_processes(monkeypatch, [2, 4, 4], this=1)
  with pytest.raises(ValueError, match=r"process 0: 2, process 1: 4, process 2: 4"):
    distributed.check_same_settings({"prompt": "a fox"})


def test_equal_counts_pass(monkeypatch):
  """Positive control: equal counts and a mesh over all of them pass; a smaller mesh still gets the
  mesh message (not the device-count one)."""
  _fake_processes(monkeypatch, [4, 4])
  assert distributed.process_device_counts() == [4, 4]
  distributed.check_mesh_spans_processes(8)
  with pytest.raises(ValueError, match="needs a mesh over all 8 devices") as e:
    distributed.check_mesh_spans_processes(4)
  assert "unequal" not in str(e.value)
