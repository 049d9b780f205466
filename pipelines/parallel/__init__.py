"""Where things run: the parallel plan (`plan`), processes (`distributed`, `supervisor`), array and
weight placement, the mesh planner (`planner`, `estimate`) and how a model's videos become tokens
(`token_facts`).

Imports `attention` and `pipelines.storage` only."""
