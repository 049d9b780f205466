"""The checked request: `GenerationRequest` (request.py) built from a call's arguments against the
model's `ModelFacts` (model_facts.py), with the checks of each kind of input (inputs.py; images,
videos, VACE's, context windows) and the seed (seed.py). Imports nothing else of `pipelines.pipeline`."""
