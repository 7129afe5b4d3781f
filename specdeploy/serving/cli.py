"""`specdeploy serve`: the OpenAI-compatible server (FastAPI + uvicorn).

Kept apart from `specdeploy/cli.py` so the web stack is imported only when serving.
"""
from __future__ import annotations

import argparse
import os

from specdeploy.cli_args import (
    DEVICE_HELP,
    DTYPE_HELP,
    MODEL_HELP,
    THREADS_HELP,
    add_budget_args,
    add_context_args,
    add_cuda_graphs_arg,
    add_parallel_args,
    add_prefix_caching_arg,
    add_vision_args,
    parallel_kwargs,
    threads_arg,
    vision_kwargs,
)
from specdeploy.serving.reasoning import PARSERS as REASONING_PARSERS
from specdeploy.serving.tools import PARSERS as TOOL_PARSERS
from specdeploy.spec_args import add_spec_args, spec_from_args


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description="Serve /v1/completions, /v1/chat/completions, "
                              "/v1/models, /tokenize, /detokenize, /version, /health and "
                              "/metrics (vLLM's flags and conventions; `specdeploy serve MODEL`).")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help=f"{MODEL_HELP}; the same as --model")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--config", metavar="FILE.yaml", help="options from a YAML file (keys are "
                   "the long option names); command-line flags override them")
    p.add_argument("--served-model-name", default=None,
                   help="the `model` id clients use (default: the checkpoint's name)")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--backend", choices=("graph", "eager"), default="graph")
    add_context_args(p)
    p.add_argument("--max-num-seqs", "--max-batch-size", dest="max_batch_size", type=int,
                   default=32, help="requests decoded together")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) replacing the "
                        "checkpoint's")
    add_budget_args(p)
    add_cuda_graphs_arg(p)
    add_spec_args(p)
    add_prefix_caching_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: local only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SPECDEPLOY_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/* (env SPECDEPLOY_API_KEY)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait beyond the batch before 429")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds shutdown waits for in-flight requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=threads_arg, default=None, help=THREADS_HELP)
    p.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info")
    p.add_argument("--stats-log-interval", type=float, default=10.0,
                   help="seconds between the one-line speculative-decoding log (0: off)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic speculative-decoding log (vLLM's flag)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                   default=None,
                   help="chat replies' <think> block (gpt-oss: the analysis channel) into "
                   "`reasoning` (vLLM's flag)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice \"auto\": calls parsed out of replies (vLLM's flag)")
    p.add_argument("--tool-call-parser", choices=TOOL_PARSERS,
                   default=None,
                   help="the format of the model's tool calls (vLLM's flag)")
    p.add_argument("--responses-store", type=int, default=0, metavar="N",
                   help="keep the last N /v1/responses in memory for GET /v1/responses/{id} "
                   "and previous_response_id (default 0: none)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="fcfs: arrival order; priority: by each request's `priority`, lower "
                   "first (vLLM's flag)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens \"token_id:<id>\" unless a request says "
                   "otherwise (vLLM's flag)")
    add_parallel_args(p)
    add_vision_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args) -> int:
    if not args.drain_timeout >= 0:  # NaN too
        raise ValueError(f"drain-timeout: must be >= 0, got {args.drain_timeout}")
    if args.max_queue < 0:
        raise ValueError(f"max-queue: must be >= 0, got {args.max_queue}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"port: must be in [0, 65535], got {args.port}")
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"model: given twice ({args.model_tag} and --model {args.model})")
    model = args.model_tag or args.model
    spec = spec_from_args(args)
    template = _chat_template(args.chat_template)
    from specdeploy.llm import LLM
    from specdeploy.serving import shutdown
    from specdeploy.serving.app import create_app

    sock = shutdown.bind(args.host, args.port)  # before loading: the port is this server's
    try:
        llm = LLM(model, dtype=args.dtype, device=args.device, max_batch_size=args.max_batch_size,
                  max_seq_len=args.max_seq_len, spec=spec, max_cache_gib=args.max_cache_gib,
                  gpu_memory_utilization=args.gpu_memory_utilization, cuda_graphs=args.cuda_graphs,
                  kv_cache_dtype=args.kv_cache_dtype,
                  num_scheduler_steps=args.num_scheduler_steps,
                  backend=args.backend, progress=True, seed=args.seed,
                  generation_config=args.generation_config,
                  enable_prefix_caching=args.enable_prefix_caching, threads=args.threads,
                  scheduling_policy=args.scheduling_policy,
                  **parallel_kwargs(args), **vision_kwargs(args))
        if template is not None:
            llm.tokenizer.chat_template = template
        if hasattr(llm.deployed, "on_failure"):  # a dead or hung rank: fail requests, then exit
            llm.deployed.on_failure(_exit_soon)
        app = create_app(llm, model_name=args.served_model_name, api_key=args.api_key,
                         max_queue=args.max_queue, drain_timeout=args.drain_timeout,
                         stats_log_interval=None if args.disable_log_stats
                         or args.stats_log_interval <= 0 else args.stats_log_interval,
                         reasoning_parser=args.reasoning_parser,
                         enable_auto_tool_choice=args.enable_auto_tool_choice,
                         tool_call_parser=args.tool_call_parser,
                         return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                         responses_store=args.responses_store)
        shutdown.run(app, host=args.host, port=args.port, log_level=args.log_level, sock=sock)
    finally:
        sock.close()
    return 0


def _chat_template(value: str | None) -> str | None:
    """vLLM's --chat-template: a path to a template file, or the template text itself."""
    if value is None:
        return None
    if "{" not in value:  # not Jinja: a path
        try:
            return open(value).read()
        except OSError as e:
            raise ValueError(f"chat-template: cannot read {value} ({e.strerror})") from None
    return value


def _exit_soon(delay: float = 1.0) -> None:
    """SIGTERM to this process after `delay` (the failed requests' errors go out first): uvicorn
    shuts down, and the server exits instead of serving with a rank missing."""
    import signal
    import time

    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGTERM)
