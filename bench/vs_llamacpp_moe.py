"""specdeploy vs llama.cpp on hybrid GGUFs (NemotronH MoE, Qwen3.5-MoE; dense Qwen3.5 with
`--archs qwen3_5`; Qwen3-Next with `--archs qwen3_next`; GLM-4.5 with `--archs glm4_moe`;
Granite 4.0-H with `--archs granite_hybrid`; gpt-oss (MXFP4 experts) with `--archs gpt_oss`;
Qwen3 / Qwen2 / Qwen3-MoE with `--archs qwen3` / `qwen3_moe`), batch 1: prefill
time and decode tokens/s on the same file, side by side in one run.

No real hybrid weights are available offline, so random mid-size checkpoints (~60-90M
parameters: hidden 512, 32 routed experts of width 512, top 4, Mamba2 / gated-delta, attention
and MoE layers) are converted by llama.cpp's own convert_hf_to_gguf.py (`--outtype q8_0`, from
the llama-cpp-python sdist: `--llamacpp-src`, as bench/gguf_convert_check.py) and both tools
run that file: llama-cpp-python (built by bench/setup_llamacpp.sh) and `LLM(path)` with its
defaults (the fast kernels, CPU graphs); `--eager` adds ours without CPU graphs. Rounds rotate
which tool goes first; each round feeds every tool the same random prompt. Greedy tokens are
compared too (random weights give flat logits: the two models' 8-bit rounding differs, so the
tokens part at near-ties; reported, not asserted).

    PYTHONPATH=.:/work/llamacpp .venv/bin/python bench/vs_llamacpp_moe.py \\
        --llamacpp-src .../llama_cpp_python-0.3.36/vendor/llama.cpp [--rounds 3] \\
        [--tokens 48] [--prompt-len 128] [--json-out FILE] [--gguf-dir DIR] [--eager]
        [--burst N] [--isolated]

`--isolated`: every run in a fresh process of its own (a warm-up run there first): in one
process the two tools' thread pools (ggml's, torch's OpenMP) slow each other.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gguf_convert_check import CONVERT  # noqa: E402
from bench.gguf_moe_blocks import CONFIG  # noqa: E402
from bench.vs_llamacpp import LlamaCpp, cpu_info  # noqa: E402

NEMOTRON = dict(CONFIG, vocab_size=4096)  # bench/gguf_moe_blocks.py's mid-size NemotronH MoE
QWEN = dict(hidden_size=512, num_hidden_layers=8, layer_types=["linear_attention"] * 3 + [
    "full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
    linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, vocab_size=4096)
# the dense Qwen3.5 of the same shape (a SwiGLU MLP of width 1536 per layer: ~50M parameters)
QWEN_DENSE = {**{k: v for k, v in QWEN.items() if not k.startswith(("num_experts", "moe_",
                                                                     "shared_expert"))},
              "intermediate_size": 1536}


def _with_a_merge_token(ckpt: Path) -> Path:
    """The converter run (bench/gguf_convert_check.py's CONVERT) gives the merge-less tiny
    tokenizer one merge, "a b", for llama.cpp; specdeploy's loader then wants "ab" in the
    vocabulary: one filler token becomes it."""
    spec = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    filler = max((t for t in vocab if t.startswith("<|filler")), key=vocab.get)
    vocab["ab"] = vocab.pop(filler)
    spec["added_tokens"] = [a for a in spec.get("added_tokens", ()) if a["content"] != filler]
    (ckpt / "tokenizer.json").write_text(json.dumps(spec))
    return ckpt


# a Qwen3-0.6B-shaped block stack (hidden 1024, 16 q / 8 kv heads of 128, MLP 3072), 8 layers
QWEN3 = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=4096,
             max_position_embeddings=4096)


# Qwen3-30B-A3B's attention (32 q / 4 kv heads of 128) and routing (128 experts, top 8) at
# hidden 1024, 48 experts of width 384, 8 layers (~0.5B parameters, ~0.1B active a token)
QWEN3_MOE = dict(QWEN3, num_attention_heads=16, num_key_value_heads=4, num_experts=48,
                 num_experts_per_tok=8, moe_intermediate_size=384, mlp_only_layers=[])


# GLM-4.5-Air's attention (heads of 128, RoPE on half, q/k/v biases) and routing (8 of 128
# experts, sigmoid, one shared expert, the first layer dense) at hidden 1024, 64 experts of width
# 256, 8 layers (+ its MTP layer, which llama.cpp's converter writes and neither tool runs here)
GLM = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
           num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=4096,
           max_position_embeddings=4096, n_routed_experts=64, num_experts_per_tok=8,
           moe_intermediate_size=256, n_group=1, topk_group=1, use_qk_norm=False)


# Granite-4.0-H-Tiny's routing (6 of 64 experts, a shared MLP) and mixers (Mamba2 heads of 64,
# one group; NoPE attention) at hidden 768, 8 layers (the 4th attention), 32 experts of width 256
GRANITE = dict(hidden_size=768, num_hidden_layers=8, layer_types=["mamba"] * 3 + ["attention"]
               + ["mamba"] * 4, num_attention_heads=12, num_key_value_heads=4, vocab_size=4096,
               num_local_experts=32, num_experts_per_tok=6, intermediate_size=256,
               shared_intermediate_size=512, mamba_n_heads=24, mamba_d_head=64, mamba_n_groups=1,
               mamba_d_state=64, mamba_chunk_size=256, attention_multiplier=0.0078125,
               embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=6.0)


def checkpoint(arch: str, out: Path) -> Path:
    return _with_a_merge_token(_checkpoint(arch, out))


def _checkpoint(arch: str, out: Path) -> Path:
    if arch == "gpt_oss":  # MXFP4 experts as released (bench/gpt_oss_mxfp4.py)
        from bench.gpt_oss_mxfp4 import make_mxfp4

        return make_mxfp4(out, seed=0)
    if arch == "qwen3_moe":
        from specdeploy.models import qwen3_moe

        return qwen3_moe.make_tiny(out, seed=0, config_overrides=QWEN3_MOE)
    if arch in ("qwen2", "qwen3"):
        from specdeploy.models import llama

        return llama.make_tiny(out, seed=0, config_overrides={
            **llama.tiny_qwen_config(arch), **QWEN3})
    if arch == "nemotron_h_moe":
        from specdeploy.models import nemotron_h as nh

        hf = nh.tiny_hf_config()
        hf.update(NEMOTRON)
        del hf["moe_latent_size"]
        return nh.make_tiny(out, seed=0, hf_config=hf)
    from specdeploy.models import qwen3_5_moe as q35

    if arch == "granite_hybrid":
        from specdeploy.models import granite_hybrid

        return granite_hybrid.make_tiny(out, seed=0, hf_config={
            **granite_hybrid.tiny_hf_config(), **GRANITE})
    if arch == "glm4_moe":
        from specdeploy.models import glm4_moe

        return glm4_moe.make_tiny(out, seed=0, hf_config={**glm4_moe.tiny_hf_config(1), **GLM})
    if arch == "qwen3_next":  # Qwen3.5-MoE's mid-size shape, Qwen3-Next's layout and RoPE
        from specdeploy.models import qwen3_next

        hf = {**qwen3_next.tiny_hf_config(mtp_layers=1), **QWEN}
        return qwen3_next.make_tiny(out, seed=0, hf_config=hf)
    # (with its MTP layer: llama.cpp 0.3.36's converter wants one for Qwen3.5; neither tool
    # runs it here)
    dense = arch == "qwen3_5"
    hf = q35.tiny_hf_config(mtp_layers=1, dense=dense)
    hf["text_config"] = dict(hf["text_config"], **(QWEN_DENSE if dense else QWEN))
    return q35.make_tiny(out, seed=0, mtp_layers=1, hf_config=hf)


def convert(src_dir: Path, ckpt: Path, out: Path, outtype: str, *extra: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{src_dir}:{src_dir / 'gguf-py'}"}
    r = subprocess.run([sys.executable, "-c", CONVERT, str(ckpt), "--outfile", str(out),
                        "--outtype", outtype, *extra], cwd=src_dir, env=env,
                       capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(f"convert_hf_to_gguf failed:\n{r.stderr[-3000:]}")


def ours_run(llm, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """(tokens, seconds to the first token, seconds after it)."""
    from specdeploy import SamplingParams

    t0 = time.perf_counter()
    (o,) = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
    wall = time.perf_counter() - t0
    decode = (len(o.token_ids) - 1) / o.metrics.decode_tokens_per_s
    return o.token_ids, wall - decode, decode


def llamacpp_run(lc: LlamaCpp, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    toks, wall, after_first = lc.run(prompt, n)
    return toks, wall - after_first, after_first


def _child(tool: str, path: str, threads: int, n_ctx: int) -> None:
    """`--child TOOL`: one tool alone in this process (a warm-up run, then the prompt read from
    stdin as JSON {"prompt", "tokens"}): prints {"tokens", "first_s", "decode_s", "version"}."""
    torch.set_num_threads(threads)
    job = json.loads(sys.stdin.read())
    version = None
    if tool == "llama.cpp":
        lc = LlamaCpp(path, threads, n_ctx)
        fn, version = partial(llamacpp_run, lc), lc.version
    else:
        from specdeploy import LLM

        fn = partial(ours_run, LLM(path, max_batch_size=1, max_seq_len=n_ctx))
    fn(list(range(3, 20)), 4)
    toks, first_s, decode_s = fn(job["prompt"], job["tokens"])
    print("CHILD " + json.dumps({"tokens": toks, "first_s": first_s, "decode_s": decode_s,
                                 "version": version}), flush=True)
    os._exit(0)  # (llama.cpp's and torch's pools need no orderly exit)


class Isolated:
    """A tool run in a fresh process per call (`--isolated`): neither tool's thread pool is
    near the other's."""

    def __init__(self, tool: str, path: Path, threads: int, n_ctx: int):
        self.args = [sys.executable, __file__, "--child", tool, "--child-path", str(path),
                     "--threads", str(threads), "--child-n-ctx", str(n_ctx),
                     "--llamacpp-src", "."]
        self.version = None

    def __call__(self, prompt: list[int], n: int) -> tuple[list[int], float, float]:
        r = subprocess.run(self.args, input=json.dumps({"prompt": prompt, "tokens": n}),
                           capture_output=True, text=True, timeout=900)
        line = next((x for x in r.stdout.splitlines() if x.startswith("CHILD ")), None)
        if line is None:
            raise RuntimeError(f"{self.args[3]} run failed:\n{r.stderr[-2000:]}")
        out = json.loads(line[len("CHILD "):])
        self.version = out["version"] or self.version
        return out["tokens"], out["first_s"], out["decode_s"]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llamacpp-src", type=Path, required=True)
    ap.add_argument("--archs", nargs="+", default=["nemotron_h_moe", "qwen3_5_moe"])
    ap.add_argument("--outtype", default="q8_0", help="convert_hf_to_gguf's --outtype")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--eager", action="store_true",
                    help="also ours without CPU graphs (engine/cpu_graphs.py), in the same rounds")
    ap.add_argument("--burst", type=int, default=0,
                    help="also ours with num_scheduler_steps=N (decode bursts), same rounds")
    ap.add_argument("--gguf-dir", type=Path,
                    help="keep the converted GGUFs here (reused when present) for profiling")
    ap.add_argument("--isolated", action="store_true",
                    help="each run in a fresh process of its own (one tool's thread pool never "
                         "beside the other's); not with --eager / --burst")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-n-ctx", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args.child, args.child_path, args.threads, args.child_n_ctx)
    if args.isolated and (args.eager or args.burst > 1):
        ap.error("--isolated runs ours with its defaults and llama.cpp only")
    from specdeploy import LLM

    torch.set_num_threads(args.threads)
    cpu = cpu_info()
    result = {"machine": cpu["model"], "simd": cpu["simd_flags"], "threads": args.threads,
              "command": " ".join(sys.argv), "outtype": args.outtype,
              "isolated": args.isolated, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs:
            keep = args.gguf_dir / f"{arch}_{args.outtype}.gguf" if args.gguf_dir else None
            path = keep or Path(tmp) / f"{arch}.gguf"
            if keep is None or not keep.exists():
                src = checkpoint(arch, Path(tmp) / arch)
                path.parent.mkdir(parents=True, exist_ok=True)
                convert(args.llamacpp_src, src, path, args.outtype)
            n_ctx = args.prompt_len + args.tokens + 8
            if args.isolated:
                lc = Isolated("llama.cpp", path, args.threads, n_ctx)
                ours = None
                tools = [("specdeploy", Isolated("specdeploy", path, args.threads, n_ctx)),
                         ("llama.cpp", lc)]
            else:
                lc = LlamaCpp(str(path), args.threads, n_ctx)
                ours = LLM(str(path), max_batch_size=1, max_seq_len=n_ctx)
                tools = [("specdeploy", partial(ours_run, ours)),
                         ("llama.cpp", partial(llamacpp_run, lc))]
            if args.eager:
                eager = LLM(str(path), max_batch_size=1, max_seq_len=n_ctx, cpu_graphs=False)
                tools.append(("specdeploy eager", partial(ours_run, eager)))
            if args.burst > 1:
                burst = LLM(str(path), max_batch_size=1, max_seq_len=n_ctx,
                            num_scheduler_steps=args.burst)
                tools.append((f"specdeploy burst{args.burst}", partial(ours_run, burst)))
            for _name, fn in tools if not args.isolated else ():  # warm-up (a child warms up)
                fn(list(range(3, 20)), 4)
            rounds = []
            for r in range(args.rounds):
                g = torch.Generator().manual_seed(r)
                prompt = torch.randint(3, 4000, (args.prompt_len,), generator=g).tolist()
                row = {}
                for name, fn in tools[r % len(tools):] + tools[:r % len(tools)]:
                    toks, first_s, decode_s = fn(prompt, args.tokens)
                    row[name] = {"tokens": toks, "prefill_s": round(first_s, 4),
                                 "decode_tok_s": round((len(toks) - 1) / decode_s, 1)}
                a, b = row["specdeploy"]["tokens"], row["llama.cpp"]["tokens"]
                row["same_tokens_prefix"] = next(
                    (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                for v in row.values():
                    if isinstance(v, dict):
                        del v["tokens"]
                rounds.append(row)
                print(arch, row, file=sys.stderr, flush=True)
            result["models"][arch] = {
                "gguf_mib": round(path.stat().st_size / 2**20, 1),
                "llamacpp_version": lc.version, "rounds": rounds,
                "decode_ratio_median": round(_median([
                    r["specdeploy"]["decode_tok_s"] / r["llama.cpp"]["decode_tok_s"]
                    for r in rounds]), 3),
                "prefill_speedup_median": round(_median([
                    r["llama.cpp"]["prefill_s"] / r["specdeploy"]["prefill_s"]
                    for r in rounds]), 3)}
            if args.eager:
                result["models"][arch]["eager_decode_ratio_median"] = round(_median([
                    r["specdeploy eager"]["decode_tok_s"] / r["llama.cpp"]["decode_tok_s"]
                    for r in rounds]), 3)
                result["models"][arch]["graphs_over_eager_median"] = round(_median([
                    r["specdeploy"]["decode_tok_s"] / r["specdeploy eager"]["decode_tok_s"]
                    for r in rounds]), 3)
                eager.shutdown()
            if args.burst > 1:
                b = f"specdeploy burst{args.burst}"
                result["models"][arch]["burst_decode_ratio_median"] = round(_median([
                    r[b]["decode_tok_s"] / r["llama.cpp"]["decode_tok_s"] for r in rounds]), 3)
                result["models"][arch]["burst_over_steps_median"] = round(_median([
                    r[b]["decode_tok_s"] / r["specdeploy"]["decode_tok_s"] for r in rounds]), 3)
                burst.shutdown()
            if ours is not None:
                ours.shutdown()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
