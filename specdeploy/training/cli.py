"""`specdeploy train-drafter`: train an EAGLE-3 or MTP head for a target on its own features."""
from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train-drafter", help="train an EAGLE-3 or MTP head for a target")
    p.add_argument("--model", default=None, help="target: HF directory or .gguf (default model)")
    p.add_argument("--method", required=True, choices=("eagle3", "mtp"))
    p.add_argument("--out", required=True, help="output directory (resumes when it has a run)")
    p.add_argument("--data", default="sharegpt",
                   help="sharegpt or FILE.jsonl; several joined by commas, each as SOURCE[:N] "
                        "(its first N training conversations)")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--max-minutes", type=float, default=None,
                   help="wall-clock budget over all (resumed) runs")
    p.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="EAGLE-3 draft vocab (MTP: training-loss vocab)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--num-samples", type=int, default=None,
                   help="training conversations used, cycled (default: all)")
    p.add_argument("--ttt-steps", type=int, default=3, help="unrolled draft steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=20, help="linear lr warmup")
    p.add_argument("--fit-batches", type=int, default=12,
                   help="closed-form warm start on this many batches (0: off)")
    p.add_argument("--init-from", default=None,
                   help="start from the weights (and draft vocab) of another run's --out dir "
                   "or of an exported head (config.json + model.safetensors)")
    p.add_argument("--init-from-checkpoint", action="store_true",
                   help="--method mtp on a NemotronH / Qwen3.5 target: fine-tune the "
                   "checkpoint's own MTP module(s) (mtp.*; group j trained for draft step j) "
                   "and write them back in its mtp.* layout")
    p.add_argument("--cache-dir", default=None, help="cache target features here (bf16)")
    p.add_argument("--save-every-minutes", type=float, default=5.0)
    p.add_argument("--save-dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when present)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_train_drafter)
    return p


def cmd_train_drafter(args) -> int:
    from specdeploy.training.trainer import TrainConfig, train

    cfg = TrainConfig(
        method=args.method, out=args.out, model=args.model, data=args.data,
        max_steps=args.max_steps, max_minutes=args.max_minutes,
        draft_vocab_size=args.draft_vocab_size, batch_size=args.batch_size,
        seq_len=args.seq_len, num_samples=args.num_samples, ttt_steps=args.ttt_steps,
        lr=args.lr, warmup_steps=args.warmup_steps, fit_batches=args.fit_batches,
        init_from=args.init_from, init_from_checkpoint=args.init_from_checkpoint,
        cache_dir=args.cache_dir,
        save_every_minutes=args.save_every_minutes,
        save_dtype=args.save_dtype, device=args.device, seed=args.seed,
        progress=not args.no_progress)
    train(cfg)
    return 0
