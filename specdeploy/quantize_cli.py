"""`specdeploy quantize`: write a loadable checkpoint as ModelOpt FP8 / NVFP4 or HF block FP8;
and `make-tiny --quant` (a tiny random checkpoint, then quantized the same way)."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    from specdeploy.checkpoint.quantizer import METHODS

    p = subparsers.add_parser("quantize", help="write a checkpoint quantized (FP8, NVFP4, "
                                               "FP8 blocks) in the released layouts")
    p.add_argument("--model", default=None, help="HF directory or .gguf (default model)")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--kv-cache", choices=("fp8",), default=None,
                   help="also declare an FP8 KV cache with calibrated k/v scales (ModelOpt)")
    p.set_defaults(func=cmd_quantize)
    return p


def cmd_quantize(args) -> int:
    from specdeploy.checkpoint.quantizer import quantize_checkpoint

    src = args.model
    if src is None:
        from specdeploy.default_model import default_model_path

        src = default_model_path()
    print(quantize_checkpoint(src, args.out, args.method, kv_cache=args.kv_cache))
    return 0


def make_tiny_quantized(arch: str, out: str | Path, quant: str, seed: int = 0,
                        mtp_layers: int = 0, kv_cache: str | None = None) -> Path:
    """`make-tiny --quant`: the family's tiny checkpoint, quantized by our own quantizer."""
    from specdeploy.checkpoint.quantizer import quantize_checkpoint
    from specdeploy.models.registry import family_module

    with tempfile.TemporaryDirectory() as tmp:
        if arch == "qwen3_vl_moe":  # per-expert keys, as FP8 releases write them
            from specdeploy.models import qwen3_vl

            src = qwen3_vl.make_tiny(Path(tmp) / arch, seed=seed, moe=True, per_expert=True)
        elif arch == "qwen3_5":  # dense Qwen3.5: the MoE family's module
            q35 = family_module("qwen3_5_moe")
            src = q35.make_tiny(Path(tmp) / arch, seed=seed, mtp_layers=mtp_layers,
                                hf_config=q35.tiny_hf_config(mtp_layers, dense=True))
        else:
            src = family_module(arch).make_tiny(Path(tmp) / arch, seed=seed,
                                                mtp_layers=mtp_layers)
        return quantize_checkpoint(src, out, quant, kv_cache=kv_cache)
