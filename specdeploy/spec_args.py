"""Speculative-decoding command-line flags, shared by `specdeploy generate/chat/bench/deploy`
and `specdeploy serve`."""
from __future__ import annotations

import argparse

from specdeploy.config import SPEC_METHODS, SpecConfig


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", choices=("none", *SPEC_METHODS), default="none")
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--draft-model", default=None, help="EAGLE-3 drafter checkpoint")
    p.add_argument("--prompt-lookup-max", type=int, default=0,
                   help="n-gram lookup drafts ahead of the drafter's (0: off; try 4)")
    p.add_argument("--prompt-lookup-min", type=int, default=2)


def spec_from_args(args) -> SpecConfig | None:
    if args.spec == "none":
        return None
    return SpecConfig(args.spec, num_draft_tokens=args.num_draft_tokens,
                      draft_model=args.draft_model, prompt_lookup_max=args.prompt_lookup_max,
                      prompt_lookup_min=args.prompt_lookup_min)
