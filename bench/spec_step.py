"""Per-step cost of speculative verification on tiny hybrids, and the spec-state memory share.

Measures, in one process and run interleaved: a plain decode step (B segments of 1 token) against
a verify step (B EXTEND segments of 1 + K tokens writing per-token states), on the same deployed
target. Prints one JSON object.

    python bench/spec_step.py [--k 3] [--batch 1 4] [--reps 30] [--default-model]

--default-model adds the same comparison on SmolLM2-135M (EAGLE-3 capture on) in three
deployments measured interleaved in this process: linears on the GGUF blocks (`ggml_linears`,
the default where its kernel builds), on fp32 weights packed for oneDNN (ggml_linears off), and
on plain fp32 weights (both off).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

from specdeploy.cache.metadata import SEG_EXTEND, Segment, build_metadata
from specdeploy.config import SpecConfig
from specdeploy.deploy.build import build
from specdeploy.models.registry import family_module


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _time(fn, reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def bench_arch(arch: str, k: int, batches: list[int], reps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        family_module(arch).make_tiny(d, seed=0, mtp_layers=1)
        sd = build(d, spec=SpecConfig("mtp", k), max_batch_size=max(batches),
                            max_seq_len=512, page_size=16, max_cache_gib=0.25)
    target = sd.target
    plan = target.plan
    prefix = 64
    pages_per_seq = 512 // plan.page_size
    rows = {}
    for b in batches:
        segs = [Segment(list(range(3, 3 + prefix)), 0,
                        list(range(i * pages_per_seq, (i + 1) * pages_per_seq)), i, 1)
                for i in range(b)]
        target.forward(build_metadata(segs))  # fill a 64-token prefix per sequence
        decode = build_metadata([Segment([5], prefix, s.pages, s.slot, 1) for s in segs])
        verify = build_metadata([Segment([5] * (k + 1), prefix, s.pages, s.slot, k + 1, SEG_EXTEND)
                                 for s in segs])
        t_dec, t_ver = [], []
        for _ in range(3):  # interleave to share machine drift
            t_dec.append(_time(lambda m=decode: target.forward(m), reps))
            t_ver.append(_time(lambda m=verify: target.forward(m), reps))
        dec, ver = statistics.median(t_dec), statistics.median(t_ver)
        rows[f"batch_{b}"] = {"decode_step_ms": dec * 1e3, "verify_step_ms": ver * 1e3,
                              "verify_over_decode": ver / dec}
    spec_bytes = plan.bytes_by_kind.get("spec_state", 0)
    return {"k": k, "steps": rows, "cache_bytes_by_kind": plan.bytes_by_kind,
            "spec_state_fraction_of_cache": spec_bytes / plan.total_bytes}


def bench_default(k: int, reps: int) -> dict:
    from specdeploy.default_model import default_model_path

    path, deps = default_model_path(), {}
    variants = (("blocks", ()), ("packed", ("ggml_linears",)),
                ("unpacked", ("ggml_linears", "pack_linear_weights")))
    for name, off in variants:
        deps[name] = build(str(path), spec=SpecConfig("eagle3", k), max_batch_size=1,
                                    max_seq_len=512, page_size=16, max_cache_gib=0.25,
                                    disabled=frozenset(off)).target
    prefix, pages = 64, list(range(512 // 16))
    metas = {"decode": build_metadata([Segment([5], prefix, pages, 0, 1)]),
             "verify": build_metadata([Segment([5] * (k + 1), prefix, pages, 0, k + 1,
                                               SEG_EXTEND)])}
    for t in deps.values():
        t.forward(build_metadata([Segment(list(range(3, 3 + prefix)), 0, pages, 0, 1)]))
    times: dict = {(n, m): [] for n in deps for m in metas}
    for _ in range(3):  # interleave to share machine drift
        for (n, m), v in times.items():
            v.append(_time(lambda t=deps[n], mm=metas[m]: t.forward(mm), reps))
    rows = {}
    for n in deps:
        dec, ver = (statistics.median(times[(n, m)]) for m in ("decode", "verify"))
        rows[n] = {"decode_step_ms": dec * 1e3, "verify_step_ms": ver * 1e3,
                   "verify_over_decode": ver / dec}
    rows["verify_unpacked_over_packed"] = (rows["unpacked"]["verify_step_ms"]
                                           / rows["packed"]["verify_step_ms"])
    rows["decode_packed_over_blocks"] = (rows["packed"]["decode_step_ms"]
                                         / rows["blocks"]["decode_step_ms"])
    return {"k": k, "batch": 1, **rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--default-model", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "threads": args.threads},
        "command": " ".join([sys.executable.rsplit("/", 1)[-1]] + sys.argv),
        "results": {arch: bench_arch(arch, args.k, args.batch, args.reps)
                    for arch in ("nemotron_h", "qwen3_5_moe")},
    }
    if args.default_model:
        out["results"]["smollm2_135m"] = bench_default(args.k, args.reps)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
