"""Speculative-decoding command-line flags, shared by `specdeploy generate/chat/bench/deploy`
and `specdeploy serve`."""
from __future__ import annotations

import argparse
import json

from specdeploy.config import CONTROLLERS, DRAFT_DTYPES, DRAFT_QUANTIZE, SPEC_METHODS, SpecConfig


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's form, instead of --spec ...: e.g. '{\"method\": \"eagle3\", "
                        "\"model\": DIR, \"num_speculative_tokens\": 3}' (methods eagle3, "
                        "mtp / deepseek_mtp / ..._mtp, ngram, suffix; prompt_lookup_max/min, "
                        "suffix_decoding_max_cached_requests, suffix_decoding_min_token_prob, "
                        "disable_by_batch_size)")
    p.add_argument("--spec", choices=("none", *SPEC_METHODS), default="none",
                   help="drafter: mtp, eagle3, ngram (n-gram lookup drafts only, no drafter), "
                        "suffix (lookup + a store of replies, no drafter), auto")
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--draft-model", default=None, help="EAGLE-3 drafter checkpoint")
    p.add_argument("--prompt-lookup-max", type=int, default=0,
                   help="n-gram lookup drafts ahead of the drafter's (0: off; try 4)")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-num-tokens", type=int, default=None,
                   help="most drafts a lookup match proposes (default: --num-draft-tokens); "
                        "runs grow from K while accepted whole; e.g. 16")
    p.add_argument("--draft-dtype", choices=DRAFT_DTYPES[1:], default=None,
                   help="run the drafter at this dtype (default: the target's; lossless "
                        "either way, drafts are verified by the target)")
    p.add_argument("--draft-quantize", choices=("none", *DRAFT_QUANTIZE[1:]), default="auto",
                   help="the drafter's weights: auto (default): q8_0 where the fast kernels run "
                        "a GGUF target on a CPU, else the target's precision; none: the "
                        "target's; int8: weight-only (with --draft-dtype bfloat16 on a CPU)")
    p.add_argument("--draft-min-prob", type=float, default=0.0,
                   help="stop a drafter chain once its probability falls below this (0: K "
                        "drafts always; try 0.1)")
    p.add_argument("--suffix-store", default=None, metavar="DIR",
                   help="a reply store (`specdeploy suffix-store`) drafted from behind lookup; "
                        "'shipped': the one shipped for this target (--spec suffix's default)")
    p.add_argument("--suffix-max-cached-requests", type=int, default=1000,
                   help="finished requests' replies the store keeps (0: none)")
    p.add_argument("--suffix-min-token-prob", type=float, default=0.1,
                   help="the store stops a chain below this estimated probability")
    p.add_argument("--spec-controller", choices=CONTROLLERS, default="cost",
                   help="cost (default): choose per step how many drafts to verify (0 "
                        "included) from this machine's measured step costs and recent "
                        "acceptance; off: fixed K, every step verifies K drafts (can be slower "
                        "than no speculation)")
    p.add_argument("--spec-disable-by-batch-size", type=int, default=None, metavar="N",
                   help="no speculation in steps where more than N sequences run (vLLM's "
                        "disable_by_batch_size; default: with the cost controller, the batch "
                        "sizes where this machine's measured step costs say drafts need a high "
                        "acceptance to pay)")


def spec_from_args(args) -> SpecConfig | None:
    raw = getattr(args, "speculative_config", None)
    if raw is not None:
        if args.spec != "none":
            raise ValueError("speculative-config: give --spec or --speculative-config, not both")
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative-config: not valid JSON ({e})") from None
        return SpecConfig.from_dict(d)
    if args.spec == "none":
        return None
    return SpecConfig(args.spec, num_draft_tokens=args.num_draft_tokens,
                      draft_model=args.draft_model, prompt_lookup_max=args.prompt_lookup_max,
                      prompt_lookup_min=args.prompt_lookup_min,
                      prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
                      draft_dtype=args.draft_dtype,
                      draft_quantize=None if args.draft_quantize == "none" else args.draft_quantize,
                      suffix_store=args.suffix_store,
                      suffix_decoding_max_cached_requests=args.suffix_max_cached_requests,
                      suffix_decoding_min_token_prob=args.suffix_min_token_prob,
                      draft_min_prob=args.draft_min_prob,
                      controller=getattr(args, "spec_controller", "cost"),
                      disable_by_batch_size=getattr(args, "spec_disable_by_batch_size", None))
