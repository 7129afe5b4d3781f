"""Routed experts of a GGUF MoE on their blocks (`ggml_moe_experts`) vs as fp32, one run.

    PYTHONPATH=. .venv/bin/python bench/gguf_moe_blocks.py [--qtype q4_0] [--tokens 48]
        [--rounds 3] [--kernels fast|exact] [--configs blocks blocks_loop fp32]
        [--json-out FILE]

A random NemotronH MoE of mid size (hidden 512, 32 experts of width 512, top 4, three MoE
layers among Mamba2 and attention ones; ~60M expert weights) is written as a GGUF the way
llama.cpp's converter writes it (tests/checkpoint/gguf_nemotron_h_layout.py), matrices and
experts in `--qtype`. Each configuration is measured in a fresh subprocess: the build with the
`ggml_moe_experts` transform (experts on blocks, loaded deferred) and with it disabled (experts
dequantized to fp32 at load); resident memory after the build, the graph's weight bytes, and
greedy decode tokens/s at batch 1 and 8, the configurations' rounds interleaved. The
logits of the two agree within fp32 summation order (tests/deploy/test_ggml_experts.py).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = dict(hidden_size=512, hybrid_override_pattern="M*EME*E", num_hidden_layers=7,
              mamba_num_heads=16, mamba_head_dim=64, ssm_state_size=64, n_groups=2,
              num_attention_heads=8, num_key_value_heads=2, head_dim=64,
              n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
              moe_shared_expert_intermediate_size=512, n_group=1, topk_group=1,
              chunk_size=64)


# name -> (label, experts on blocks, environment)
CONFIGS = {"blocks": ("blocks", "1", {}), "fp32": ("fp32", "0", {}),
           "blocks_loop": ("blocks_loop", "1", {"SPECDEPLOY_GGML_MOE": "0"})}


def write(out: Path, qtype: str) -> Path:
    from specdeploy.models import nemotron_h as nh
    from tests.checkpoint.gguf_nemotron_h_layout import Q, write_gguf

    hf = nh.tiny_hf_config()
    hf.update(CONFIG)
    del hf["moe_latent_size"]
    src = nh.make_tiny(out / "st", seed=0, hf_config=hf)
    q = getattr(Q, qtype.upper())
    return write_gguf(src, out / f"moe_{qtype}.gguf", qtype=q, expert_qtype=q)


def _rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(path: str, on_blocks: bool, tokens: int, kernels: str) -> dict:
    """In this process: build, then greedy decode at batch 1 and 8."""
    import torch

    from specdeploy.deploy.build import build
    from specdeploy.engine import Engine, SamplingParams

    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    dep = build(path, max_batch_size=8, max_seq_len=256, max_cache_gib=0.1, kernels=kernels,
                disabled=frozenset() if on_blocks else frozenset({"ggml_moe_experts"}))
    load_s = time.perf_counter() - t0
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    info = {i.name: i for i in dep.infos}["ggml_moe_experts"]
    weights = sum(t.nbytes for _, t in dep.gm.named_parameters())
    out = {"load_s": round(load_s, 2), "rss_mib": round(_rss_mib(), 1),
           "graph_param_mib": round(weights / 2**20, 1),
           "ggml_moe_experts": info.detail}
    eng = Engine(dep, None, max_batch_size=8, max_num_tokens=512)

    def run(bs: int, n: int) -> int:
        for i in range(bs):
            eng.add_request([3 + (7 * i + j) % 100 for j in range(12)],
                            SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
        made = 0
        while eng.has_unfinished():
            made += sum(len(o.delta_token_ids) for o in eng.step())
        return made

    for bs in (1, 8):
        run(bs, 2)  # warm-up
        t0 = time.perf_counter()
        made = run(bs, tokens)
        out[f"decode_tok_s_bs{bs}"] = round(made / (time.perf_counter() - t0), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--qtype", default="q4_0", choices=["q4_0", "q4_1", "q8_0"])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--kernels", default="fast", choices=["fast", "exact"],
                    help="the block kernels (LLM's default: fast)")
    ap.add_argument("--configs", nargs="+", default=["blocks", "fp32"], choices=list(CONFIGS),
                    help="what to measure, the first against each other (blocks_loop: the "
                    "experts on blocks one kernel call per expert matrix, not one per layer)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        path, on, tokens, kernels = args.child
        print(json.dumps(measure(path, on == "1", int(tokens), kernels)))
        return
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "command": " ".join(sys.argv), "config": CONFIG, "qtype": args.qtype,
              "rounds": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp), args.qtype)
        result["gguf_mib"] = round(path.stat().st_size / 2**20, 1)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        configs = [CONFIGS[c] for c in args.configs]
        for r in range(args.rounds):
            row = {}
            for name, on, extra in configs[r % len(configs):] + configs[:r % len(configs)]:
                p = subprocess.run([sys.executable, __file__, "--child", str(path), on,
                                    str(args.tokens), args.kernels], capture_output=True,
                                   text=True, env={**env, **extra}, timeout=1800)
                if p.returncode:
                    raise RuntimeError(p.stderr[-3000:])
                row[name] = json.loads(p.stdout.strip().splitlines()[-1])
            result["rounds"].append(row)
    names = [CONFIGS[c][0] for c in args.configs]
    for bs in (1, 8):
        key = f"decode_tok_s_bs{bs}"
        for other in names[1:]:
            ratios = sorted(r[names[0]][key] / r[other][key] for r in result["rounds"])
            result[f"{names[0]}_vs_{other}_{key}_median"] = round(ratios[len(ratios) // 2], 3)
    result["rss_mib"] = [{n: r[n]["rss_mib"] for n in names} for r in result["rounds"]]
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
