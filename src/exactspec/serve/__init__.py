"""`exactspec serve`: an OpenAI-compatible HTTP server with continuous batching.

- `app`: the FastAPI application (endpoints, streaming, errors in OpenAI's shape);
- `scheduler`: the engine thread (queue, rows joining at round boundaries, cancellation);
- `protocol`: the request fields accepted and checked, per-request speculative metrics;
- `text`: incremental detokenization and stop strings;
- `metrics`: Prometheus metrics named like vLLM's.

Needs the `serve` extra (fastapi, uvicorn, prometheus-client); `import exactspec` does not
import this package.
"""
