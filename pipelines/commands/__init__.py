"""What the two commands share, `generate` (`pipelines.cli`) and `serve` (`pipelines.serve`), so that
neither imports the other: the published sampling defaults they start from (`presets`), the flag
pieces both parse (`flags`: `UsageError`, a LoRA's PATH[:SCALE], --decode-compile-effort), the
`--help` layout and warning lines of every command line, end_to_end's tools' too (`help`), the
versions an output's sidecar records (`versions`), and flax imported without IPython (`startup`).
Imports `pipelines.pipeline` and below, and no JAX."""
