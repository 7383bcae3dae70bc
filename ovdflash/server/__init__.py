"""`ovdflash serve`: an OpenAI-compatible HTTP server with DFlash inside (FastAPI + uvicorn).

Layout: `protocol` (request models, their checks, error JSON, response bodies), `tool_calls` (the
model's tool-call formats, parsed whole or streamed), `engine` (the one
worker thread that owns the pipeline, and per-request event queues), `backends` (what the worker
steps: one request at a time, or continuous batching), `metrics` (Prometheus), `app` (the FastAPI
app and the uvicorn server), `wiring` (a loaded pipeline, its KV pool, backend, engine and metrics
made into an app: what `ovdflash serve` and each Ray replica build), `ray_app` (replicas on Ray
Serve). May import: the pipeline (and its `token_generation.sampling_params`), the text layer, `grammar`
(structured outputs' checks), `decode` (stats, sampling parameters), `ov`
(memory, the paged pool's sizing); never `cli` or `bench`. Only this package imports fastapi.
docs/SERVING.md describes the behaviour.
"""
