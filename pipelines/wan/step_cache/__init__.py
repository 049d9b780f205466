"""Step caching for the denoise loop (first-block residual cache, MagCache): the spec strings, the
cached forward, and what a MagCache calibration was made for.

The names below are imported on first use (`lazy_facade`), so that importing the package
imports none of its modules, and a JAX-free module among them loads without JAX.
"""

from lazy_facade import lazy_facade

_HOMES = (
    ("pipelines.wan.step_cache.calibration", ("FIELDS", "check_calibration", "record_fields", "warn_other_calibration")),
    ("pipelines.wan.step_cache.forward", ("cached_forward", "checkpoint_template", "constrain",
                                          "for_checkpoint", "init_state", "place", "reset")),
    ("pipelines.wan.step_cache.windows", ("cached_windows",)),
    ("pipelines.wan.step_cache.spec", ("MAG_DEFAULT_MAX_SKIPS", "MAG_DEFAULT_RETENTION", "METHODS",
                                       "SPEC_HELP", "StepCacheError", "StepCacheSpec", "TINY_RATIOS_FILE",
                                       "nearest_interp", "parse_step_cache", "summary")),
)

__all__, __getattr__ = lazy_facade(__name__, _HOMES)
