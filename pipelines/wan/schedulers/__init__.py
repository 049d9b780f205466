"""Flow-matching samplers for Wan, one module per solver (`unipc`: Wan's default, `euler`, `dpm_solver`),
what they share (`flow_schedule`: custom schedules, the flow shift) and the solvers by name (`registry`).

The names below are imported on first use (`lazy_facade`), so that importing the package
imports none of its modules, and a JAX-free module among them loads without JAX.
"""

from lazy_facade import lazy_facade

_HOMES = (
    ("pipelines.wan.schedulers.dpm_solver", ("DPMSolverConfig", "DPMSolverSchedule", "DPMSolverState")),
    ("pipelines.wan.schedulers.euler", ("FlowEulerConfig", "FlowEulerSchedule", "FlowEulerState")),
    ("pipelines.wan.schedulers.flow_schedule", ("custom_sigmas",)),
    ("pipelines.wan.schedulers.registry", ("SOLVERS", "SchedulerConfig", "flow_shift",
                                           "scheduler_config_from_dict", "solver_name", "switch_solver",
                                           "with_flow_shift")),
    ("pipelines.wan.schedulers.unipc", ("UniPCConfig", "UniPCSchedule", "UniPCState")),
)

__all__, __getattr__ = lazy_facade(__name__, _HOMES)
