"""`specdeploy gen-drafter-data`: the target's own replies to training-split prompts, as JSONL.

A drafter is judged on how often it guesses what *the target* says next. ShareGPT's replies were
written by other models, so a small target's features on them describe contexts it never produces
itself; replies the target generated (greedy by default, as the acceptance bench decodes) train
the head on exactly the distribution it will draft from. Prompts are the first user turns of the
*training* split only (the held-out split stays unseen); each record keeps the exact token ids,
so training reads them back without a tokenizer round trip, and a sidecar `FILE.meta.json` records
the source's held-out split. Re-running appends only the prompts not yet in the file.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from pathlib import Path

from specdeploy.training import data as data_mod


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("gen-drafter-data",
                              help="write the target's own replies to training prompts (JSONL)")
    p.add_argument("--model", default=None, help="target: HF directory or .gguf (default model)")
    p.add_argument("--out", required=True, help="JSONL file (appended to; resumes)")
    p.add_argument("--data", default="sharegpt", help="prompt source: sharegpt or FILE.jsonl")
    p.add_argument("--num-prompts", type=int, required=True)
    p.add_argument("--max-tokens", type=int, default=256, help="reply length cap")
    p.add_argument("--max-prompt-tokens", type=int, default=192)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=32, help="sequences decoded together")
    p.add_argument("--chunk", type=int, default=64, help="prompts per written chunk")
    p.add_argument("--engine", choices=("specdeploy", "transformers"), default="specdeploy",
                   help="decode with our engine (CPU) or transformers' generate on our weights "
                        "(GPU when present; needs transformers)")
    p.add_argument("--device", default=None, help="--engine transformers: cpu / cuda")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new chunk after this long (what is written stays whole)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard", default="0/1",
                   help="K/N: this process takes every N-th prompt from the K-th (parallel runs)")
    p.set_defaults(func=cmd_gen)
    return p


def training_prompts(tokenizer, source: str, n: int, max_prompt_tokens: int
                     ) -> tuple[list[tuple[str, str, list[int]]], dict]:
    """The first `n` usable training-split prompts (id, clipped user text, token ids) in a seeded
    order, and the held-out metadata of the source."""
    convs = data_mod.load_conversations(source)
    side = data_mod.source_meta(source)
    if side is not None and "source_heldout" in side:  # already a training split (see below)
        train, held_meta = convs, side["source_heldout"]
    else:
        train, held = data_mod.split(convs)
        held_meta = data_mod.split_metadata(source, held)
    out = []
    for conv in train:
        if len(out) >= n:
            break
        first = next((m for m in conv.messages if m["role"] == "user"), None)
        if first is None:
            continue
        ids = data_mod.prompt_ids(tokenizer, conv, max_prompt_tokens)
        if len(ids) < max_prompt_tokens:  # whole prompts only: a cut one is not a chat turn
            out.append((conv.id, first["content"][:data_mod.MAX_USER_CHARS], ids))
    return out, held_meta


def generate_file(llm, prompts, out: Path, max_tokens: int, temperature: float, chunk: int,
                  seed: int = 0, log=print, max_minutes: float | None = None) -> int:
    """Append one record per prompt not yet in `out`; returns the number written now. `llm`:
    anything with `generate(prompt ids, params)` (an `LLM`, an `HFGenerator`)."""
    from specdeploy import SamplingParams

    done = set()
    if out.exists():
        with out.open(encoding="utf-8") as f:
            done = {json.loads(line)["id"] for line in f if line.strip()}
    todo = [p for p in prompts if p[0] not in done]
    written, t0, toks = 0, time.perf_counter(), 0
    for i in range(0, len(todo), chunk):
        if max_minutes is not None and time.perf_counter() - t0 >= 60 * max_minutes:
            log(f"stopping after {max_minutes} min; re-run to continue")
            break
        part = todo[i:i + chunk]
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                 seed=seed + zlib.crc32(pid.encode()) % 100_000)
                  for pid, _, _ in part]
        outs = llm.generate([ids for _, _, ids in part], params)
        with out.open("a", encoding="utf-8") as f:
            for (pid, text, ids), o in zip(part, outs):
                rec = {"id": pid, "messages": [{"role": "user", "content": text},
                                               {"role": "assistant", "content": o.text}],
                       "token_ids": ids + o.token_ids, "prompt_len": len(ids),
                       "finish_reason": o.finish_reason}
                f.write(json.dumps(rec) + "\n")
        written += len(part)
        toks += sum(len(o.token_ids) for o in outs)
        dt = max(time.perf_counter() - t0, 1e-9)
        log(f"{len(done) + written}/{len(prompts)} prompts, {toks} tokens in {dt:.0f}s "
            f"({toks / dt:.1f} tok/s)")
    return written


def cmd_gen(args) -> int:
    import torch

    from specdeploy.llm import LLM

    try:
        k, n = (int(x) for x in args.shard.split("/"))
    except ValueError:
        k = n = -1
    if not 0 <= k < n:  # checked before the (slow) model load
        raise ValueError(f"--shard: want K/N with 0 <= K < N, got {args.shard!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.engine == "transformers":
        llm = _hf_engine(args)
    else:
        llm = LLM(args.model, dtype="float32", max_batch_size=args.batch_size,
                  max_seq_len=args.max_prompt_tokens + args.max_tokens + 16, progress=True)
    prompts, held = training_prompts(llm.tokenizer, args.data, args.num_prompts,
                                     args.max_prompt_tokens)
    prompts = prompts[k::n]
    meta = {"source": args.data, "source_heldout": held, "model": str(llm.model_path),
            "command": " ".join(sys.argv), "temperature": args.temperature,
            "max_tokens": args.max_tokens, "max_prompt_tokens": args.max_prompt_tokens,
            "engine": args.engine}
    Path(str(out) + ".meta.json").write_text(json.dumps(meta, indent=1))
    generate_file(llm, prompts, out, args.max_tokens, args.temperature, args.chunk, args.seed,
                  log=lambda m: print(m, file=sys.stderr, flush=True),
                  max_minutes=args.max_minutes)
    return 0


def _hf_engine(args):
    """An `HFGenerator` on the target's fp32 weights, with the EOS ids our engine stops on."""
    import specdeploy
    from specdeploy.default_model import default_model_path
    from specdeploy.tokenizer import eos_token_ids
    from specdeploy.training.hf_generate import HFGenerator

    path = Path(args.model) if args.model else default_model_path()
    model = specdeploy.load_model(path, dtype="float32")
    tokenizer = specdeploy.load_tokenizer(path)
    gen = HFGenerator(model, tokenizer, eos_token_ids(tokenizer, model.hf_config, path),
                      batch_size=args.batch_size, device=args.device)
    gen.model_path = path
    print(f"transformers engine on {gen.device}, batches of {args.batch_size}", file=sys.stderr,
          flush=True)
    return gen
