"""The re-quantized GGUFs the vs-llama.cpp benches time (`--gguf-dir`): bench/vs_llamacpp_moe.py's
random mid-size checkpoints converted to F16 by llama.cpp's converter, then quantized by
llama-cpp-python's `llama_model_quantize` (llama-quantize's file types: Q4_K_M, IQ3_M, ...).
Files are `DIR/{arch}_{type}.gguf` (the names `--outtype TYPE --gguf-dir DIR` reads); existing
ones are kept.

    PYTHONPATH=.:/work/llamacpp .venv/bin/python bench/requant_ggufs.py \\
        --llamacpp-src .../llama_cpp_python-0.3.36/vendor/llama.cpp --dir /tmp/kq \\
        --types q4_k_m,iq3_m --archs qwen3_5_moe nemotron_h_moe qwen3_5

llama-quantize writes IQ1 / IQ2 / IQ3_XXS only with an importance matrix (not settable from
Python): bench/iq_retype.py makes those kinds from an IQ3_M file instead.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.vs_llamacpp_moe import checkpoint, convert  # noqa: E402

FTYPES = {"q8_0": 7, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "iq3_m": 27, "iq4_xs": 30,
          "q3_k_m": 12, "q2_k": 10}  # llama.h's LLAMA_FTYPE_MOSTLY_*


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llamacpp-src", type=Path, required=True)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--types", default="q4_k_m,iq3_m", help=f"of {', '.join(FTYPES)}")
    ap.add_argument("--archs", nargs="+", default=["qwen3_5_moe", "nemotron_h_moe", "qwen3_5"])
    args = ap.parse_args()
    import llama_cpp

    types = args.types.split(",")
    bad = [t for t in types if t not in FTYPES]
    if bad:
        ap.error(f"--types: unknown {bad}; known: {', '.join(FTYPES)}")
    args.dir.mkdir(parents=True, exist_ok=True)
    for arch in args.archs:
        f16 = args.dir / f"{arch}_f16.gguf"
        if not f16.exists():
            with tempfile.TemporaryDirectory() as tmp:
                convert(args.llamacpp_src, checkpoint(arch, Path(tmp) / arch), f16, "f16")
        for kind in types:
            out = args.dir / f"{arch}_{kind}.gguf"
            if out.exists():
                continue
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.nthread = FTYPES[kind], 2
            rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), params)
            if rc:
                raise SystemExit(f"llama_model_quantize {arch} {kind}: returned {rc}")
            print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
