"""OpenAI-compatible HTTP server (`specdeploy serve`), following vLLM's conventions.

- `protocol.py`: the shared request fields, validation (errors name the field), completions.
- `chat.py`: chat requests and the chat template's options; `tokenize.py`: /tokenize and
  /detokenize; `fields.py`: which request fields are known, refused or ignored.
- `sampling_fields.py`: `n`, logprobs, penalties, `min_p` / `min_tokens` and structured
  outputs (`response_format`, `guided_json`, `structured_outputs`) → SamplingParams;
  `token_fields.py`: prompt truncation and token ids in responses.
- `body.py`: the JSON body's checks; `errors.py`: OpenAI-style errors; `responses.py`: response
  and streamed-chunk bodies; `logprobs_format.py`: logprobs in OpenAI's shapes.
- `engine_loop.py`: the one thread that owns the engine and batches every connection's requests.
- `metrics.py`: Prometheus metrics (prometheus_client, vLLM's names); `stats_log.py`: the
  periodic speculative-decoding log line.
- `app.py`: the FastAPI app factory `create_app(llm, ...)`; `replies.py`: a request's streamed
  chunks or whole response from the engine loop's events.
- `cli.py`: the `serve` subcommand; `shutdown.py`: draining on SIGTERM.
"""
from __future__ import annotations
