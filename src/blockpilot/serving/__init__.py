"""`blockpilot serve`: an OpenAI-compatible HTTP server over a `Runner`, and its Ray Serve deployment.

- `app`: the FastAPI app (`create_app`) and `run_server` (uvicorn, drain on SIGTERM).
- `scheduler`: the thread that owns the `BatchDecoder`, with a bounded waiting queue.
- `protocol`: the OpenAI request models and response/error bodies.
- `text`: incremental detokenization and stop strings.
- `metrics`: the Prometheus metric families.
- `ray_deployment`: N replicas of the app behind Ray Serve's router.

Nothing is imported here, so `import blockpilot.serving` pulls in neither FastAPI nor Ray.
"""
