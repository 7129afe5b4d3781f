"""Where the fused decoder layer's time goes, by rows in the step (1: decode, 1 + K: verify).

    .venv/bin/python bench/layer_phases.py [--k 3] [--num-prompts 6] [--max-tokens 128]
        [--threads 2] [--json-out FILE]

Builds a timed copy of ops/layer_rows.c (the same calls, with a clock read between them: the
q/k/v linear, RoPE, cache write + attention, the o linear, the gate/up linear, the down linear,
and the two add + RMSNorm with SiLU-mul), runs greedy requests of held-out ShareGPT prompts on
the default model with fixed-K suffix drafts (so steps of 1 and of 1 + K rows both occur), and
prints per row count the milliseconds per step of each phase summed over the layers, and the
cost of an extra row per phase ((t(R) - t(1)) / (R - 1)). The copy is this bench's only: the
deployment's own library is untouched (another file name, its own cache entry).
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import torch

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.bench import machine, print_json
from specdeploy.checkpoint import open_checkpoint
from specdeploy.default_model import default_model_path
from specdeploy.ops import layer_rows
from specdeploy.training import data

PHASES = ("qkv", "rope", "attention", "o", "norms_silu", "gate_up", "down")
MAX_R = 16
# the linear / rope / attend / ... calls of decoder_layer_rows, each followed by its phase index
TIMED = [("    if (linear(L, &L->qkv, normed, R, qkv, th)) return -1;\n", 0),
         ("    L->rope(qkv, R, heads, L->d, L->qkv.n, st->cos_, st->sin_, st->rot, qk, th);\n", 1),
         (" " * 29 + "L->scale, attn, th, (int)L->kv, (int)L->window, L->sinks);\n", 2),
         ("    if (linear(L, &L->o, attn, R, o, th)) return -1;\n", 3),
         ("    L->add_norm(res, o, R, h, L->w_post, L->eps_post, res2, normed2, th);\n", 4),
         ("    if (linear(L, &L->gate_up, normed2, R, gu, th)) return -1;\n", 5),
         ("    L->silu_mul(gu, R, L->n_ff, L->gate_up.n, m, th);\n", 4),
         ("    if (linear(L, &L->down, m, R, dn, th)) return -1;\n", 6),
         ("    L->add_norm(res2, dn, R, h, L->w_next, L->eps_next, res_out, normed_out, th);\n", 4)]


def timed_source(src: str) -> str:
    """layer_rows.c with a clock read after each call, summed per (rows, phase)."""
    head = ("#include <time.h>\n"
            f"static double T_[{MAX_R + 1}][8]; static long long N_[{MAX_R + 1}];\n"
            "static double now_(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);"
            " return t.tv_sec + 1e-9 * t.tv_nsec; }\n"
            f"void layer_times(double *o) {{ for (int r = 0; r <= {MAX_R}; r++) {{"
            " for (int p = 0; p < 8; p++) o[r * 9 + p] = T_[r][p];"
            " o[r * 9 + 8] = (double)N_[r]; } }\n")
    src = src.replace("#include <stdint.h>\n", "#include <stdint.h>\n" + head, 1)
    start = "    if (linear(L, &L->qkv, normed, R, qkv, th)) return -1;\n"
    src = src.replace(start, f"    const int b_ = R < {MAX_R} ? R : {MAX_R}; N_[b_]++;\n"
                      "    double t0_ = now_(), t1_;\n" + start, 1)
    for line, phase in TIMED:
        if line not in src:
            raise SystemExit(f"layer_rows.c changed: {line.strip()!r} not found; update TIMED")
        src = src.replace(line, line + f"    t1_ = now_(); T_[b_][{phase}] += t1_ - t0_; "
                          "t0_ = t1_;\n", 1)
    return src


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="layer_phases_"))
    timed = tmp / "layer_rows_timed.c"
    timed.write_text(timed_source(layer_rows.SOURCE.read_text()))
    layer_rows.SOURCE = timed  # NOTE: before the first deployment builds the library
    layer_rows._library.cache_clear()
    spec = SpecConfig("suffix", args.k, controller="off", suffix_decoding_max_cached_requests=0)
    llm = LLM(None, dtype="float32", max_batch_size=1, max_seq_len=1024, spec=spec)
    lib = layer_rows._library()[0]
    if lib is None:
        raise SystemExit("the fused decoder layer is unavailable here")
    layers = int(open_checkpoint(default_model_path()).config["num_hidden_layers"])
    _, held = data.split(data.load_conversations("sharegpt"))
    prompts = [data.prompt_ids(llm.tokenizer, c, 256) for c in held[:args.num_prompts]]
    llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))
    buf = (ctypes.c_double * ((MAX_R + 1) * 9))()
    lib.layer_times(buf)
    base = list(buf)
    for p in prompts:
        llm.generate([p], SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    lib.layer_times(buf)
    v = [a - b for a, b in zip(buf, base)]
    rows = {}
    for r in range(1, MAX_R + 1):
        calls = v[r * 9 + 8]
        steps = calls / layers
        if steps < 5:
            continue
        ms = {p: round(1e3 * v[r * 9 + i] / steps, 4) for i, p in enumerate(PHASES)}
        rows[r] = {"steps": int(steps), "ms_per_step": ms,
                   "total_ms": round(sum(ms.values()), 4)}
    if 1 in rows:
        for r, row in rows.items():
            if r > 1:
                row["ms_per_extra_row"] = {
                    p: round((row["ms_per_step"][p] - rows[1]["ms_per_step"][p]) / (r - 1), 4)
                    for p in PHASES}
                row["over_one_row"] = round(row["total_ms"] / rows[1]["total_ms"], 3)
    print_json({"machine": machine(), "command": " ".join(["bench/layer_phases.py"]
                                                           + sys.argv[1:]),
                "layers": layers, "threads": args.threads, "k": args.k,
                "note": "milliseconds per step, summed over the fused layers (the LM head, "
                        "embedding and engine work outside them are not here)",
                "rows": rows}, args.json_out)


if __name__ == "__main__":
    main()
