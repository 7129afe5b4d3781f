"""OpenAI-compatible HTTP server (`specdeploy serve`).

- `protocol.py`: request parsing and validation (errors name the field), response/chunk bodies.
- `engine_loop.py`: the one thread that owns the engine and batches every connection's requests.
- `metrics.py`: Prometheus text exposition.
- `app.py`: the FastAPI app factory `create_app(llm, ...)`.
- `cli.py`: the `serve` subcommand.
"""
from __future__ import annotations
