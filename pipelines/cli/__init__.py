"""The `generate` command (`generate`): flags, presets, the run plan, run records, output writing,
exit codes. The top layer: imports `pipelines.pipeline` and everything below it, lazily where JAX
would slow `--help`."""
