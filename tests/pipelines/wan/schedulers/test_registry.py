"""The samplers by name and by diffusers' `_class_name` (pipelines/wan/schedulers/registry.py): a Wan
`scheduler_config.json` and one diffusers writes read back as our configs, and switching solvers keeps
the flow shift."""

import json

import numpy as np
import pytest
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from pipelines.wan import schedulers
from tests.pipelines.wan.schedulers.test_unipc import WAN_UNIPC_CONFIG

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


def test_from_config_reads_wan_scheduler_config(tmp_path):
  cfg = schedulers.scheduler_config_from_dict(WAN_UNIPC_CONFIG)
  assert cfg == schedulers.UniPCConfig(flow_shift=3.0)
  ref = UniPCMultistepScheduler.from_config(WAN_UNIPC_CONFIG)
  ref.set_timesteps(30)
  np.testing.assert_array_equal(cfg.set_timesteps(30).timesteps, ref.timesteps.numpy())
  # A scheduler_config.json written by diffusers round-trips too.
  FlowMatchEulerDiscreteScheduler(shift=7.0).save_config(tmp_path)
  with open(tmp_path / "scheduler_config.json") as f:
    cfg = schedulers.scheduler_config_from_dict(json.load(f))
  assert cfg == schedulers.FlowEulerConfig(shift=7.0)


def test_switch_solver_keeps_the_shift():
  unipc = schedulers.UniPCConfig(flow_shift=3.0)
  dpm = schedulers.switch_solver(unipc, "dpm++")
  assert dpm == schedulers.DPMSolverConfig(flow_shift=3.0)
  assert schedulers.switch_solver(dpm, "euler") == schedulers.FlowEulerConfig(shift=3.0)
  assert schedulers.switch_solver(unipc, "unipc") is unipc
  with pytest.raises(ValueError, match="unipc, euler, dpm"):
    schedulers.switch_solver(unipc, "ddim")
