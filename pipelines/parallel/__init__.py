"""Where things run: the parallel plan (`plan`), processes (`distributed`, `supervisor`), array and
weight placement, the mesh planner (`planner`, `estimate`).

Imports `attention` and `pipelines.storage` only."""
