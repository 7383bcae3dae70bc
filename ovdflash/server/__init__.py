"""`ovdflash serve`: an OpenAI-compatible HTTP server with DFlash inside (FastAPI + uvicorn).

Layout: `protocol` (request models, their checks, error JSON, response bodies), `async_engine`
(the scheduler and the one worker thread that owns the pipeline), `metrics` (Prometheus),
`app` (the FastAPI app and the uvicorn server), `load` (`ovdflash bench-serve`, a load
generator for any OpenAI-compatible endpoint). Only this package imports fastapi; the runtime
(`ovdflash.pipeline`) never does. docs/SERVING.md describes the behaviour.
"""
