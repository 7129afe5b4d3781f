"""Sliding-window attention at decode and verify sizes: the C row kernel with its window bound
(attention_rows.c, since stop 56) against the torch path windowed layers took before (`_decode`
over the sequence's whole page table under a mask; verify rows one 1-row SDPA each over every
key, then masked), and against the same kernel without a window. Interleaved rep by rep, one
process, medians in ms. Prints one JSON object.

    python bench/window_attention.py [--context 4096] [--window 128] [--threads 2]

Shapes: Mistral-7B's attention (32 query heads, 8 KV heads, head size 128), one sequence, an
fp32 cache (the exact path's) and a bf16 one (the fast path's).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.vs_llamacpp import cpu_info  # noqa: E402
from specdeploy.ops import attention_rows  # noqa: E402
from specdeploy.ops import cached_attention as ca  # noqa: E402


def _old_rows(q, kc, vc, pages, pos0, scale, window):
    """What a windowed verify segment ran before: per row, SDPA over its visible keys."""
    keys, vals = ca._seq_kv(kc, vc, pages, pos0 + q.shape[0])
    out = []
    for i in range(q.shape[0]):
        end = pos0 + i + 1
        a = max(0, end - window)
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[i:i + 1].transpose(0, 1)[None].float(), keys[a:end].transpose(0, 1)[None].float(),
            vals[a:end].transpose(0, 1)[None].float(), scale=scale, enable_gqa=True)[0]
            .transpose(0, 1))
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hq, hkv, d, ps = 32, 8, 128, 16
    pages_n = (args.context + 8) // ps + 1
    g = torch.Generator().manual_seed(0)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        kc = torch.randn(pages_n, ps, hkv, d, generator=g).to(dtype)
        vc = torch.randn(pages_n, ps, hkv, d, generator=g).to(dtype)
        pages = torch.arange(pages_n)
        for rows in (1, 4):
            q = torch.randn(rows, hq, d, generator=g)
            pos0 = args.context - rows
            scale = d ** -0.5
            if rows == 1:
                lens = torch.tensor([pos0])

                def old(q=q, kc=kc, vc=vc, lens=lens, pages=pages, scale=scale):
                    return ca._decode(q, kc, vc, pages[None], lens, scale, args.window)
            else:
                def old(q=q, kc=kc, vc=vc, pos0=pos0, pages=pages, scale=scale):
                    return _old_rows(q, kc, vc, pages, pos0, scale, args.window)
            def kernel(window, q=q, kc=kc, vc=vc, pos0=pos0, pages=pages, scale=scale):
                return attention_rows.attention_rows(q, kc, vc, pages, pos0, scale, window)
            cases = {"torch_path_before": old,
                     "kernel_window": lambda: kernel(args.window),
                     "kernel_full_context": lambda: kernel(0)}
            ref = cases["torch_path_before"]().float()
            err = (cases["kernel_window"]() - ref).abs().max().item()
            times = {k: [] for k in cases}
            for _ in range(args.reps):
                for k, fn in cases.items():
                    t0 = time.perf_counter()
                    fn()
                    times[k].append((time.perf_counter() - t0) * 1e3)
            med = {k: round(statistics.median(v), 4) for k, v in times.items()}
            results[f"{str(dtype).split('.')[-1]}_rows{rows}"] = {
                "ms": med, "max_abs_diff_kernel_vs_torch": err,
                "speedup_vs_before": round(med["torch_path_before"] / med["kernel_window"], 2)}
    out = {"bench": "window_attention", "command": " ".join(sys.argv), "machine": cpu_info(),
           "context": args.context, "window": args.window, "threads": args.threads,
           "shape": {"hq": hq, "hkv": hkv, "d": d}, "results": results}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
