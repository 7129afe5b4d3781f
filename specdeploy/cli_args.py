"""Command-line options shared by `specdeploy` subcommands, the benches and training: the model
and sampling flags and the objects built from them (beneath cli.py, bench.py and training/)."""
from __future__ import annotations

import argparse

from specdeploy.spec_args import add_spec_args, spec_from_args


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--max-cache-gib", type=float, default=None)
    p.add_argument("--backend", choices=("graph", "eager"), default="graph")
    add_spec_args(p)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--quantize", choices=("none", "int8"), default="none",
                   help="weight-only int8 (lm_head, routers and the drafter excluded)")
    p.add_argument("--compile", action="store_true", help="torch.compile the deployed graph")
    add_prefix_caching_arg(p)


def add_prefix_caching_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="share cached prompt prefixes (KV pages, recurrent "
                   "checkpoints); --no-enable-prefix-caching turns it off")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def llm_from_args(args, max_batch_size: int):
    from specdeploy.llm import LLM

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    return LLM(args.model, dtype=args.dtype, max_batch_size=max_batch_size,
               max_seq_len=args.max_seq_len, spec=spec_from_args(args),
               max_cache_gib=args.max_cache_gib,
               backend=args.backend, progress=True, compile=args.compile,
               enable_prefix_caching=args.enable_prefix_caching,
               quantize=None if args.quantize == "none" else args.quantize)


def sampling_from_args(args, **extra):
    from specdeploy.engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, **extra)
