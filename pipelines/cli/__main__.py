"""`python -m pipelines.cli` runs `generate`."""

from pipelines.cli.generate import cli

cli()
