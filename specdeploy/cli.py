"""The `specdeploy` command: generate, chat, bench, plot, deploy, make-tiny, serve, ..."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from specdeploy.cli_args import (
    add_cuda_graphs_arg,
    add_model_args,
    add_sampling_args,
    llm_from_args,
    parallel_kwargs,
    sampling_from_args,
    vision_kwargs,
)
from specdeploy.spec_args import spec_from_args

# Speculative-decoding counters copied from `LLM.stats()` into `generate --json`.
SPEC_STATS = ("num_draft_tokens", "draft_steps", "draft_tokens", "accepted_tokens",
              "acceptance_rate", "mean_accepted_length", "accepted_per_position",
              "acceptance_per_position", "lookup_steps", "lookup_accepted_tokens",
              "store_steps", "store_accepted_tokens",
              "undrafted_steps", "controlled_steps", "batch_off_steps", "steps_by_num_drafts",
              "spec_off_batch_sizes")


def cmd_generate(args) -> int:
    sp = sampling_from_args(args)  # validate before the (slow) load
    images, videos = args.image or [], args.video or []
    if images:
        from specdeploy.vision import load_image

        for p in images:
            load_image(p, f"--image {p}")
    for p in videos:  # fail before the (slow) load
        if not os.path.isfile(p):
            from specdeploy.vision.video_decode import VideoError

            raise VideoError(f"--video {p}: no such file")
    llm = llm_from_args(args, max_batch_size=1)
    t0 = time.perf_counter()
    if args.chat:
        parts = [{"type": "video", "video": p} for p in videos]
        parts += [{"type": "image", "image": p} for p in images]
        content = parts + [{"type": "text", "text": args.prompt}] if parts else args.prompt
        (out,) = llm.chat([{"role": "user", "content": content}], sp)
    else:  # a raw prompt writes one placeholder per --image / --video itself
        (out,) = llm.generate(args.prompt, sp, images=images or None, videos=videos or None)
    wall = time.perf_counter() - t0
    m = out.metrics
    if args.json:
        record = {"text": out.text, "token_ids": out.token_ids,
                  "finish_reason": out.finish_reason, "prompt_tokens": len(out.prompt_token_ids),
                  "tokens_per_s": len(out.token_ids) / wall if wall > 0 else None,
                  "decode_tokens_per_s": m.decode_tokens_per_s, "ttft_s": m.ttft}
        record.update({k: v for k, v in llm.stats().items() if k in SPEC_STATS})
        print(json.dumps(record))
    else:
        print(out.text)
        print(f"[{len(out.token_ids)} tokens, {len(out.token_ids) / wall:.1f} tokens/s, "
              f"finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    llm = llm_from_args(args, max_batch_size=1)
    sp = sampling_from_args(args)
    history: list[dict] = []
    print("chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        text = ""
        for out in llm.generate_stream(llm.chat_ids(history), sp):
            print(out.delta_text, end="", flush=True)
            text = out.text
        print()
        history.append({"role": "assistant", "content": text})
    return 0


def cmd_make_tiny(args) -> int:
    if args.arch == "eagle3":
        if not args.target:
            raise SystemExit("make-tiny --arch eagle3 needs --target DIR (the target checkpoint)")
        from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

        path = make_tiny_eagle3(args.target, args.out, seed=args.seed)
    elif args.arch == "qwen3_5" and not args.quant:
        from specdeploy.models import qwen3_5_moe as q35

        path = q35.make_tiny(args.out, seed=args.seed, mtp_layers=args.mtp_layers,
                             hf_config=q35.tiny_hf_config(args.mtp_layers, dense=True))
    elif args.arch == "gemma3_vl" and not args.quant:
        from specdeploy.models import gemma3_vision_tiny

        path = gemma3_vision_tiny.make_tiny(args.out, seed=args.seed, mtp_layers=args.mtp_layers)
    elif args.arch == "qwen3_vl_moe" and not args.quant:
        from specdeploy.models import qwen3_vl

        path = qwen3_vl.make_tiny(args.out, seed=args.seed, mtp_layers=args.mtp_layers, moe=True)
    elif args.quant:
        from specdeploy.quantize_cli import make_tiny_quantized

        path = make_tiny_quantized(args.arch, args.out, args.quant, seed=args.seed,
                                   mtp_layers=args.mtp_layers)
    else:
        from specdeploy.models.registry import family_module

        path = family_module(args.arch).make_tiny(args.out, seed=args.seed,
                                                  mtp_layers=args.mtp_layers)
    print(path)
    return 0


def cmd_deploy(args) -> int:
    from specdeploy.deploy.build import describe

    if not args.list_transforms:
        print("deploy: nothing to do (use --list-transforms)", file=sys.stderr)
        return 2
    # with --tensor-parallel-size: rank 0's program alone (no other process is started)
    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.default_model import default_model_path
    from specdeploy.distributed import dist_config
    from specdeploy.model_defaults import resolve_max_len

    par = parallel_kwargs(args)
    dist = dist_config(par["tensor_parallel_size"], par["expert_parallel_size"],
                       par["shard_layers"])
    max_len = resolve_max_len(open_checkpoint(args.model or default_model_path()).config,
                              max_seq_len=args.max_seq_len)
    print(describe(args.model, dtype=args.dtype, device=args.device,
                   max_seq_len=max_len, max_cache_gib=args.max_cache_gib,
                   gpu_memory_utilization=args.gpu_memory_utilization,
                   kv_cache_dtype=args.kv_cache_dtype,
                   spec=spec_from_args(args), kernels=args.kernels, dist=dist,
                   enable_prefix_caching=args.enable_prefix_caching,
                   **vision_kwargs(args)))
    return 0


def cmd_bench(args) -> int:
    from specdeploy.bench import run_bench, summary_table

    result = run_bench(args)
    # the table for people (stderr with --json, so stdout stays one JSON object)
    print(summary_table(result), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0


def cmd_plot(args) -> int:
    from specdeploy.plot import plot_bench

    for path in plot_bench(args.bench_json, args.out):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from specdeploy.version import version

    ap = argparse.ArgumentParser(prog="specdeploy", description=__doc__)
    ap.add_argument("--version", action="version", version=f"specdeploy {version()}")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    add_model_args(g)
    add_sampling_args(g, max_tokens=64)
    add_cuda_graphs_arg(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the chat template")
    g.add_argument("--image", action="append", metavar="PATH",
                   help="an image (vision-language models; repeatable): with --chat it comes "
                   "before the prompt, else each fills one <|image_pad|> of the prompt")
    g.add_argument("--video", action="append", metavar="PATH",
                   help="a video file (vision-language models; PyAV decodes it; repeatable): "
                   "with --chat it comes first, else each fills one <|video_pad|> of the prompt")
    g.add_argument("--json", action="store_true", help="last line: one JSON object")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat")
    add_model_args(c)
    add_sampling_args(c, max_tokens=256)
    add_cuda_graphs_arg(c)
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", help="throughput / latency on ShareGPT or a JSONL file")
    add_model_args(b)
    add_cuda_graphs_arg(b)
    b.add_argument("--dataset", default="sharegpt", help="sharegpt or FILE.jsonl ({'prompt': ..})")
    b.add_argument("--num-prompts", type=int, default=32)
    b.add_argument("--concurrency", type=int, default=16)
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are cut")
    b.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    b.add_argument("--json", action="store_true", help="stdout: one JSON object (the table "
                   "goes to stderr)")
    b.set_defaults(func=cmd_bench)

    pl = sub.add_parser("plot", help="PNG charts of a bench JSON (needs matplotlib: the "
                        "`plot` extra)")
    pl.add_argument("bench_json", help="the JSON of `specdeploy bench --json` or bench/*.py")
    pl.add_argument("--out", required=True, help="directory for the PNG files")
    pl.set_defaults(func=cmd_plot)

    d = sub.add_parser("deploy", help="show the transform pipeline and cache plan")
    add_model_args(d)
    d.add_argument("--list-transforms", action="store_true")
    d.set_defaults(func=cmd_deploy)

    t = sub.add_parser("make-tiny", help="write a tiny random checkpoint")
    t.add_argument("--arch", required=True,
                   choices=("llama", "nemotron_h", "qwen3_5_moe", "qwen3_5", "qwen3_moe",
                            "qwen3_vl", "qwen3_vl_moe", "qwen3_next", "glm4_moe",
                            "deepseek_v3", "granite_hybrid", "gpt_oss", "gemma3",
                            "gemma3_vl", "lfm2", "eagle3"),
                   help="qwen3_5: the dense Qwen3.5 VLM (qwen3_5_moe's blocks, an MLP per "
                        "layer); qwen3_vl(_moe): Qwen3-VL(-MoE) with DeepStack; gemma3_vl: "
                        "Gemma 3 with its SigLIP tower")
    t.add_argument("--mtp-layers", type=int, default=0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--target", default=None, help="target checkpoint (for --arch eagle3)")
    t.add_argument("--out", required=True)
    t.add_argument("--quant", choices=("fp8", "nvfp4", "fp8-block"), default=None,
                   help="write it pre-quantized (ModelOpt FP8 / NVFP4, HF FP8 blocks)")
    t.set_defaults(func=cmd_make_tiny)
    from specdeploy.quantize_cli import add_parser as add_quantize
    add_quantize(sub)
    from specdeploy.serving.cli import add_parser as add_serve  # web stack imported on use only
    add_serve(sub)
    from specdeploy.training.cli import add_parser as add_train_drafter
    add_train_drafter(sub)
    from specdeploy.training.selfgen import add_parser as add_gen_data
    add_gen_data(sub)
    from specdeploy.suffix_cli import add_parser as add_suffix_store
    add_suffix_store(sub)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    from specdeploy.config_file import expand_config

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand_config(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
