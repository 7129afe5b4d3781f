"""Decode and verify step times on hybrid GGUFs with the recurrent mixers fused into one C call
each (`fuse_recurrent_mixers`) and without (the graph's chain), measured interleaved in one
process on the same files. Prints one JSON object.

    PYTHONPATH=.:/work/llamacpp python bench/mixer_steps.py \\
        --llamacpp-src /path/to/llama.cpp [--gguf A.gguf B.gguf] [--k 3] [--batch 1 4]

Without --gguf it makes bench/vs_llamacpp_moe.py's random mid-size NemotronH-MoE and
Qwen3.5-MoE checkpoints and converts them with llama.cpp's own converter (Q8_0). Each step is
timed on the deployed target directly (`forward(metadata)`), `--reps` times per configuration,
configurations alternating rep by rep; medians in ms. A verify step is B EXTEND segments of
1 + K tokens (what a speculative step verifies), a decode step B segments of 1 token.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.vs_llamacpp import cpu_info  # noqa: E402

OFF = frozenset({"fuse_recurrent_mixers"})


def _steps(dep, batch: int, k: int):
    from specdeploy.cache.metadata import SEG_EXTEND, SEG_NORMAL, Segment, build_metadata

    g = torch.Generator().manual_seed(0)
    prompt = 40
    ids = [torch.randint(3, 200, (prompt + k + 1,), generator=g).tolist() for _ in range(batch)]
    page = dep.target.layout.page_size
    need = -(-(prompt + k + 2) // page)
    pages = [list(range(need * s, need * s + need)) for s in range(batch)]
    for s in range(batch):
        dep.forward(build_metadata([Segment(ids[s][:prompt], 0, pages[s], s, 1)]))
    decode = build_metadata([Segment([ids[s][prompt]], prompt, pages[s], s, 1, SEG_NORMAL)
                             for s in range(batch)])
    verify = build_metadata([Segment(ids[s][prompt:prompt + k + 1], prompt, pages[s], s, k + 1,
                                     SEG_EXTEND) for s in range(batch)])
    return decode, verify


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, nargs="*")
    ap.add_argument("--llamacpp-src", type=Path)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    from specdeploy.deploy.build import build

    torch.set_num_threads(args.threads)
    cpu = cpu_info()
    result = {"machine": cpu["model"], "simd": cpu["simd_flags"], "threads": args.threads,
              "command": " ".join(sys.argv), "k": args.k, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        paths = list(args.gguf or [])
        if not paths:
            from bench.vs_llamacpp_moe import checkpoint, convert

            if args.llamacpp_src is None:
                ap.error("--llamacpp-src (its converter makes the GGUFs) or --gguf")
            for arch in ("nemotron_h_moe", "qwen3_5_moe"):
                out = Path(tmp) / f"{arch}.gguf"
                convert(args.llamacpp_src, checkpoint(arch, Path(tmp) / arch), out, "q8_0")
                paths.append(out)
        for path in paths:
            kw = dict(kernels="fast", max_batch_size=max(args.batch), max_seq_len=128,
                      max_cache_gib=0.3, spec={"method": "ngram",
                                               "num_speculative_tokens": args.k})
            deps = {"fused": build(str(path), **kw), "chain": build(str(path), disabled=OFF, **kw)}
            matched = {i.name: i for i in deps["fused"].target.infos}["fuse_recurrent_mixers"]
            per_batch = {}
            for b in args.batch:
                metas = {name: _steps(dep, b, args.k) for name, dep in deps.items()}
                times = {(n, s): [] for n in deps for s in ("decode", "verify")}
                with torch.inference_mode():
                    for rep in range(args.reps + 3):
                        for name, dep in deps.items():
                            for step, meta in zip(("decode", "verify"), metas[name]):
                                t0 = time.perf_counter()
                                dep.forward(meta)
                                if rep >= 3:  # warm-up reps dropped
                                    times[(name, step)].append(time.perf_counter() - t0)
                med = {f"{n}_{s}_ms": round(statistics.median(v) * 1e3, 3)
                       for (n, s), v in times.items()}
                med["verify_over_decode_fused"] = round(
                    med["fused_verify_ms"] / med["fused_decode_ms"], 3)
                med["verify_over_decode_chain"] = round(
                    med["chain_verify_ms"] / med["chain_decode_ms"], 3)
                med["decode_speedup"] = round(med["chain_decode_ms"] / med["fused_decode_ms"], 3)
                med["verify_speedup"] = round(med["chain_verify_ms"] / med["fused_verify_ms"], 3)
                per_batch[f"batch_{b}"] = med
            result["models"][path.stem] = {"mixers_fused": matched.num_matches, **per_batch}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
