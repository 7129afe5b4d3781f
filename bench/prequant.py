"""Pre-quantized checkpoints: load time, memory and decode speed per format, one run.

    .venv/bin/python bench/prequant.py [--models tiny,default] [--decode-tokens 32]
        [--acceptance-prompts 8] [--json-out FILE]

For each model (a tiny Qwen3.5-MoE and/or the default model, SmolLM2-135M from its GGUF), the
plain checkpoint and `specdeploy quantize` copies (fp8 = ModelOpt FP8 with static activation
scales, fp8-block = HF 128x128 blocks, nvfp4 = ModelOpt NVFP4 weight-only) are each measured in
a fresh subprocess: `LLM(...)` construction time (load + export + transforms + cache), resident
memory after it (current and peak: the plain model's dequantized copy is freed once the graph
holds the quantized weights), and greedy decode tokens/s at batch 1 and 16 (ignore_eos). For the
default model also the shipped MTP head's acceptance on the FP8 target vs the fp32 one.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FORMATS = ("fp32", "bf16", "fp8", "fp8-block", "nvfp4")


def _rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure_one(path: str, dtype: str, decode_tokens: int) -> dict:
    """In this process: build, then decode at batch 1 and 16."""
    from specdeploy import LLM, SamplingParams
    from specdeploy.bench import peak_rss_mib

    t0 = time.perf_counter()
    llm = LLM(path, dtype=dtype, max_batch_size=16, max_seq_len=256, max_cache_gib=0.25)
    load_s = time.perf_counter() - t0
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # NOTE: freed heap back to the OS, so RSS counts
    deployed = getattr(llm.deployed, "target", llm.deployed)
    caches = {f"{h.name}{s}" for h in deployed.resources for s in ("", "_k", "_v")}
    weights = sum(t.nbytes for n, t in [*deployed.gm.named_parameters(),
                                        *deployed.gm.named_buffers()] if n not in caches)
    out = {"load_s": round(load_s, 2), "rss_mib": round(_rss_mib(), 1),
           "peak_rss_mib": round(peak_rss_mib(), 1), "graph_weights_mib": round(weights / 2**20, 1)}
    params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
    vocab = llm.deployed.vocab_size
    for bs in (1, 16):
        prompts = [[3 + (7 * i + j) % (vocab - 3) for j in range(8)] for i in range(bs)]
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t0
        out[f"decode_tok_s_bs{bs}"] = round(sum(len(o.token_ids) for o in outs) / dt, 1)
    return out


def acceptance(path: str, n_prompts: int, k: int = 3) -> dict:
    """Shipped MTP head on this target: acceptance over a few chat prompts, greedy."""
    from specdeploy import LLM, SamplingParams, SpecConfig

    llm = LLM(path, spec=SpecConfig("mtp", k, controller="off"), max_batch_size=8, max_seq_len=512)
    topics = ["the water cycle", "how a CPU cache works", "the French revolution",
              "photosynthesis", "binary search", "why the sky is blue", "TCP vs UDP",
              "the rules of chess", "how vaccines work", "compound interest"]
    convs = [[{"role": "user", "content": f"Explain {t} in a few sentences."}]
             for t in (topics * 2)[:n_prompts]]
    llm.chat(convs, SamplingParams(max_tokens=64))
    s = llm.stats()
    return {"k": k, "prompts": n_prompts, **{key: round(s[key], 3) for key in (
        "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length")}}


def _sub(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          check=False)
    if proc.returncode:
        return {"error": proc.stderr.strip()[-500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,default")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--acceptance-prompts", type=int, default=8, help="0: skip acceptance")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per measurement (1: robust on a shared, loaded machine)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--one", nargs=2, metavar=("PATH", "DTYPE"), help=argparse.SUPPRESS)
    ap.add_argument("--accept", metavar="PATH", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(measure_one(args.one[0], args.one[1], args.decode_tokens)))
        return
    if args.accept:
        print(json.dumps(acceptance(args.accept, args.acceptance_prompts)))
        return
    from specdeploy.bench import machine, print_json
    from specdeploy.checkpoint.quantizer import quantize_checkpoint

    result = {"machine": machine(), "decode_tokens": args.decode_tokens,
              "threads": args.threads, "load_average": list(os.getloadavg()), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "tiny":
                from specdeploy.models.qwen3_5_moe import make_tiny

                src = str(make_tiny(Path(tmp) / "tiny", seed=0))
            else:
                from specdeploy.default_model import default_model_path

                src = str(default_model_path())
            rows = {}
            for fmt in FORMATS:
                path, quant_s = src, None
                if fmt not in ("fp32", "bf16"):
                    t0 = time.perf_counter()
                    path = str(quantize_checkpoint(src, Path(tmp) / f"{name}-{fmt}", fmt))
                    quant_s = round(time.perf_counter() - t0, 1)
                row = _sub(["--one", path, "bfloat16" if fmt == "bf16" else "auto",
                            "--decode-tokens", str(args.decode_tokens),
                            "--threads", str(args.threads)])
                rows[fmt] = {**({"quantize_s": quant_s} if quant_s else {}), **row}
                print(name, fmt, rows[fmt], file=sys.stderr, flush=True)
            entry = {"source": src, "formats": rows}
            if name == "default" and args.acceptance_prompts:
                entry["mtp_acceptance"] = {
                    fmt: _sub(["--accept", path, "--acceptance-prompts",
                               str(args.acceptance_prompts), "--threads", str(args.threads)])
                    for fmt, path in (("fp32", src), ("fp8", str(Path(tmp) / f"{name}-fp8")))}
            result["models"][name] = entry
    print_json(result, args.json_out)


if __name__ == "__main__":
    main()
