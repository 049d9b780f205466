"""`serve`: a video generation service over one loaded `WanPipeline` (OpenAI's Videos API shape).

Modules: `options` (the command's flags, `ServeConfig`), `api` (request and response bodies, the
checks that map a request onto `GenerationRequest.build`), `store` (the durable SQLite job table),
`worker` (the one thread that owns the devices: batches, hooks, outputs), `multihost` (process 0's
decisions broadcast to the other processes), `service` (model, store, worker and metrics together),
`app` (the FastAPI routes), `main` (the console script). Imports `pipelines.commands` (presets and
flag pieces it shares with `generate`) and below; nothing of `pipelines.cli`.
"""
