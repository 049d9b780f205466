"""The `generate` command (`generate`): flags, the run plan, run records, output writing, exit codes.
Imports `pipelines.commands` (presets and flag pieces it shares with `serve`), `pipelines.pipeline`
and everything below them, lazily where JAX would slow `--help`; never `pipelines.serve`."""
