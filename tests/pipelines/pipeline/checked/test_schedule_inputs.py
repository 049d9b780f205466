"""`checked.schedule_inputs`: the model's scheduler, another solver or a given config, with a flow
shift in range; the step count from `num_inference_steps` or a custom schedule, at most the
scheduler's trained noise levels."""

import pytest

from pipelines.pipeline.checked.model_facts import ModelFacts
from pipelines.pipeline.checked.schedule_inputs import FLOW_SHIFT_RANGE, check_schedule, scheduler_of
from pipelines.wan import schedulers

FACTS = ModelFacts.tiny_random("float32")


def test_the_model_s_scheduler_another_solver_or_a_given_config():
  assert scheduler_of(FACTS, None, None) == FACTS.scheduler
  assert scheduler_of(FACTS, "dpm++", None) == schedulers.switch_solver(FACTS.scheduler, "dpm++")
  assert isinstance(scheduler_of(FACTS, "dpm++", None), schedulers.DPMSolverConfig)
  given = schedulers.FlowEulerConfig(shift=7.0)
  assert scheduler_of(FACTS, given, None) == given
  shifted = scheduler_of(FACTS, None, 5.0)
  assert shifted == schedulers.with_flow_shift(FACTS.scheduler, 5.0) and shifted != FACTS.scheduler
  with pytest.raises(ValueError, match=r"scheduler=3 must be None \(the model's\), one of"):
    scheduler_of(FACTS, 3, None)


@pytest.mark.parametrize("shift", [FLOW_SHIFT_RANGE[0] / 2, FLOW_SHIFT_RANGE[1] * 2])
def test_a_flow_shift_outside_its_range_is_refused(shift):
  with pytest.raises(ValueError, match=r"flow_shift=.* must be in \[0.01, 1000\]"):
    scheduler_of(FACTS, None, shift)
  assert scheduler_of(FACTS, None, FLOW_SHIFT_RANGE[1]) == schedulers.with_flow_shift(FACTS.scheduler, 1000.0)  # an end


def test_the_step_count_from_steps_or_a_custom_schedule():
  assert check_schedule(FACTS, None, None, 8, None, None)[1] == 8
  assert check_schedule(FACTS, None, None, None, [1000.0, 750.0, 500.0, 250.0], None)[1] == 4
  with pytest.raises(ValueError, match=r"num_inference_steps=1001 must be at most 1000"):
    check_schedule(FACTS, None, None, 1001, None, None)
  with pytest.raises(ValueError, match=r"num_inference_steps"):
    check_schedule(FACTS, None, None, "8", None, None)
