"""The GPU bench of issue 25, one run: the default model at batch size 1 (plain, shipped MTP and
EAGLE-3 heads, n-gram lookup, each at fixed K = 3 and under the cost controller) with CUDA
graphs, the Triton kernels and the drafter's graphs on, then with each off (what each buys),
plus plain eager, against transformers' `generate` on the same device and weights; batch-1 rows
over held-out ShareGPT prompts (--prompt-ids); where a decode step's time goes
(`step_profile`); 64 concurrent ShareGPT requests; a tiny hybrid's verify-step / decode-step
time ratio.

    python bench/gpu_bench.py [--device cuda] [--dtype bfloat16] [--json-out FILE]
    python bench/gpu_bench.py --device cpu --dtype float32 --quick   # a smoke run anywhere

Greedy, EOS ignored (both sides make the same number of tokens). Prints one JSON object; with
--json-out the file is rewritten after every phase, so a run cut short by its time limit still
leaves what it measured. A phase that fails records its error and the others go on.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.bench import (
    hf_model_from_checkpoint,
    load_prompts,
    machine,
    print_json,
    run_closed_loop,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (its phases' profilers)
from gpu_profiles import _sync, host_profile, hybrid_verify_ratio, step_profile  # noqa: E402


@torch.inference_mode()
def hf_decode_rate(model, ids: list[int], n: int, device: str) -> float:
    x = torch.tensor([ids], device=device)

    def gen(k: int) -> float:
        _sync(device)
        t = time.perf_counter()
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=k, min_new_tokens=k,
                       do_sample=False, pad_token_id=0)
        _sync(device)
        return time.perf_counter() - t

    gen(4)  # warm-up
    return (n - 1) / (gen(n) - gen(1))


def bs1(args, spec: SpecConfig | None, prompts: list[list[int]], cuda_graphs: bool = False,
        burst: int = 1) -> dict:
    """Each prompt alone at batch size 1, `args.rounds` times after a warm-up round (graph
    captures and Triton compiles happen on first use of a shape): tokens/s of a round = its
    decode tokens over its decode time (all prompts); the median round."""
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_batch_size=1,
              max_seq_len=1024, spec=spec, cuda_graphs=cuda_graphs, num_scheduler_steps=burst)
    sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    # a whole round first where graphs replay (each shape's capture and compiles happen on its
    # first use); eager, one short reply
    for prompt in prompts if cuda_graphs else prompts[:1]:
        llm.generate([prompt], sp if cuda_graphs else SamplingParams(max_tokens=8,
                                                                      ignore_eos=True))
    rates, ids = [], []
    for _ in range(args.rounds):
        tokens, seconds, ids = 0, 0.0, []
        for prompt in prompts:
            (out,) = llm.generate([prompt], sp)
            n = len(out.metrics.token_times) - 1  # the first is the prefill's
            tokens, seconds = tokens + n, seconds + n / out.metrics.decode_tokens_per_s
            ids += out.token_ids
        rates.append(tokens / seconds)
    s = llm.stats()
    return {"tokens_per_s": sorted(rates)[len(rates) // 2], "rounds": rates,
            "prompts": len(prompts), "mean_accepted_length": s.get("mean_accepted_length"),
            "token_ids": ids}


class Phases:
    """Runs named phases in order, each timed and guarded; the JSON is rewritten after each."""

    def __init__(self, result: dict, path: str | None):
        self.result, self.path = result, path
        result["phase_s"], result["errors"] = {}, {}

    def __call__(self, name: str, fn):
        from specdeploy.ops import gpu_kernels

        t = time.perf_counter()
        try:
            value = fn()
        except Exception as e:  # a bench records a failure rather than stop the others
            value = None
            self.result["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            print(f"[{name}] FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        # back to the defaults (on unless SPECDEPLOY_TRITON=0; the fused norm + linear off
        # unless SPECDEPLOY_TRITON_GEMV=1): a phase that switched them is over
        gpu_kernels.set_enabled(os.environ.get("SPECDEPLOY_TRITON", "1") != "0")
        gpu_kernels.set_gemv(os.environ.get("SPECDEPLOY_TRITON_GEMV", "0") == "1")
        self.result["phase_s"][name] = round(time.perf_counter() - t, 2)
        print(f"[{name}] {self.result['phase_s'][name]} s", file=sys.stderr, flush=True)
        if self.path:
            Path(self.path).write_text(json.dumps(self.result, indent=2) + "\n")
        return value


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--dataset", default="sharegpt", help="'sharegpt' or a JSONL of prompts")
    ap.add_argument("--prompt-ids", default=None,
                    help="JSON list of prompt token-id lists for the batch-1 rows (held-out "
                    "ShareGPT first turns from bench/gpu_prepare.sh); default: one story prompt")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="batch-1 runs per row (median)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--lean", action="store_true",
                    help="on a GPU, skip the rows without the Triton kernels (but plain's)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.concurrency, args.rounds = 16, 4, 1
    cuda = torch.device(args.device).type == "cuda"
    result = {
        "machine": machine(), "command": " ".join(sys.argv), "device": args.device,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "dtype": args.dtype, "tokens": args.tokens, "bs1": {},
    }
    phase = Phases(result, args.json_out)
    probe = LLM(args.model, dtype=args.dtype, device=args.device, max_batch_size=1,
                max_seq_len=512)
    prompts = [probe.chat_ids([{"role": "user",
                                "content": "Tell me a long story about a robot."}])]
    if args.prompt_ids:
        prompts = json.loads(Path(args.prompt_ids).read_text())
    result["bs1_prompts"] = {"count": len(prompts), "tokens": [len(p) for p in prompts],
                             "source": args.prompt_ids or "story prompt"}
    model_path, tokenizer = probe.model_path, probe.tokenizer
    del probe

    def hf() -> float:
        model = hf_model_from_checkpoint(model_path).to(args.device, getattr(torch, args.dtype))
        return hf_decode_rate(model, prompts[0], args.tokens, args.device)

    hf_rate = phase("transformers", hf)
    result["transformers_bs1_tokens_per_s"] = hf_rate
    rows = result["bs1"]
    fixed = dict(controller="off")  # fixed K, as measured for issue 25
    specs = {"plain": None,
             "mtp": SpecConfig("mtp", 3, **fixed),
             "eagle3": SpecConfig("eagle3", 3, **fixed),
             "ngram": SpecConfig("ngram", 3, prompt_lookup_max=4, **fixed),
             # the cost controller (the default): drafts only where they pay on this device
             "mtp_ctl": SpecConfig("mtp", 3),
             "eagle3_ctl": SpecConfig("eagle3", 3),
             "ngram_ctl": SpecConfig("ngram", 3, prompt_lookup_max=4),
             # lookup + the shipped store of the model's replies (engine/suffix_store.py); no
             # learning from finished requests: the rounds ask the same prompts again
             "suffix": SpecConfig("suffix", 3, suffix_decoding_max_cached_requests=0, **fixed),
             "suffix_k6": SpecConfig("suffix", 6, suffix_decoding_max_cached_requests=0,
                                     **fixed),
             "suffix_ctl": SpecConfig("suffix", 3, prompt_lookup_num_tokens=8,
                                      suffix_decoding_max_cached_requests=0),
             # the controller over up to 6 drafts: if it beats suffix_ctl here, `auto` should
             # take K = 6 on CUDA (replay of the bench's prompts on the CPU, 2026-12-05: 2.08
             # tokens a step at K = 6 against 1.93 at K = 3)
             "suffix_k6_ctl": SpecConfig("suffix", 6, prompt_lookup_num_tokens=8,
                                         suffix_decoding_max_cached_requests=0),
             # what `SpecConfig("auto")` / `--spec auto` resolves to for this model
             # (no learning from finished requests: the rounds repeat the prompts)
             "auto": SpecConfig("auto", suffix_decoding_max_cached_requests=0)}

    def variant(name: str, graphs: bool, triton: bool = False, drafter_graphs: bool = False,
                burst: int = 1, gemv: bool = False) -> None:
        """One row: `name`'s spec with CUDA graphs (target), the Triton kernels
        (ops/gpu_kernels.py) and the drafter's chain steps as graphs, each on or off; `burst`:
        decode bursts (LLM(num_scheduler_steps=burst), engine/decode_burst.py); `gemv`: the
        fused RMSNorm + linear (+ SiLU-gated product) kernel (ops/norm_linear.py) too."""
        key = name + "_cuda_graphs" * graphs + "_triton" * triton + "_gemv" * gemv \
            + "_drafter_graphs" * drafter_graphs + (f"_burst{burst}" if burst > 1 else "")

        def run() -> dict:
            from specdeploy.ops import gpu_kernels

            gpu_kernels.set_enabled(triton)  # `Phases` turns them off after
            gpu_kernels.set_gemv(gemv)
            os.environ["SPECDEPLOY_DRAFT_GRAPHS"] = "1" if drafter_graphs else "0"
            try:
                return bs1(args, specs[name], prompts, cuda_graphs=graphs, burst=burst)
            finally:
                os.environ.pop("SPECDEPLOY_DRAFT_GRAPHS", None)

        row = phase(key, run)
        if row is not None:
            rows[key] = row

    def concurrent(triton: bool, burst: int = 1, spec: SpecConfig | None = None) -> dict:
        from specdeploy.ops import gpu_kernels

        gpu_kernels.set_enabled(triton)
        llm = LLM(args.model, dtype=args.dtype, device=args.device,
                  max_batch_size=args.concurrency, max_seq_len=1024, cuda_graphs=cuda,
                  num_scheduler_steps=burst, spec=spec)
        ids = [tokenizer.encode(t)[:512] for t in load_prompts(args.dataset, args.concurrency)]
        sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        run_closed_loop(llm, ids[:2], SamplingParams(max_tokens=8, ignore_eos=True), 2)
        conc = run_closed_loop(llm, ids, sp, args.concurrency)
        out = {"requests": len(ids), "cuda_graphs": cuda, "triton": triton, "burst": burst,
               "spec": None if spec is None else spec.method,
               "tokens_per_s": conc["output_tokens_per_s"], "wall_s": conc["wall_s"]}
        if hf_rate:
            out["vs_transformers_bs1"] = conc["output_tokens_per_s"] / hf_rate
        return out

    if not cuda:  # a smoke run: the plain rows
        result["step_profile"] = phase("step_profile", lambda: step_profile(args, prompts[0]))
        for name in specs:
            variant(name, False)
    else:
        # the rows the goals are about first (the defaults: graphs, Triton kernels, drafter
        # graphs): a run cut short keeps them
        result["step_profile_triton"] = phase(
            "step_profile_triton", lambda: step_profile(args, prompts[0], triton=True))
        variant("plain", True, triton=True)
        variant("plain", True, triton=True, burst=8)
        variant("plain", True)
        for name in ("mtp", "eagle3", "ngram", "suffix", "suffix_k6", "mtp_ctl", "eagle3_ctl",
                     "ngram_ctl", "suffix_ctl", "auto"):
            variant(name, True, triton=True, drafter_graphs=name in ("mtp", "eagle3", "mtp_ctl",
                                                                     "eagle3_ctl"))
        # the fused RMSNorm + linear kernel (off by default until these rows measure it against
        # cuBLAS + the separate norms): 7 launches a layer instead of 10
        variant("plain", True, triton=True, gemv=True)
        variant("plain", True, triton=True, gemv=True, burst=8)
        result["step_profile_triton_gemv"] = phase(
            "step_profile_triton_gemv",
            lambda: step_profile(args, prompts[0], triton=True, gemv=True))
        variant("suffix_k6_ctl", True, triton=True)
        variant("suffix_ctl", True, triton=True, gemv=True)
        result["host_profile"] = phase("host_profile", lambda: host_profile(args, prompts[0]))
        result["concurrent_triton"] = phase("concurrent_triton", lambda: concurrent(True))
        result["concurrent_triton_burst8"] = phase("concurrent_triton_burst8",
                                                   lambda: concurrent(True, 8))
        # speculation at 64 requests: what `auto` does where every verify row is a real row
        result["concurrent_triton_auto"] = phase(
            "concurrent_triton_auto", lambda: concurrent(True, spec=SpecConfig(
                "auto", suffix_decoding_max_cached_requests=0)))
        for name in ("mtp", "eagle3"):  # what the drafter's graphs buy
            variant(name, True, triton=True)
        if not args.lean:  # without the Triton kernels (what they buy)
            result["step_profile"] = phase("step_profile",
                                           lambda: step_profile(args, prompts[0]))
            for name in ("mtp", "eagle3", "ngram", "mtp_ctl", "eagle3_ctl"):
                variant(name, True)
    if not (cuda and args.lean):
        result["concurrent"] = phase("concurrent", lambda: concurrent(False))
    result["tiny_hybrid_verify_over_decode"] = phase("hybrid_ratio",
                                                     lambda: hybrid_verify_ratio(args))
    if cuda:
        args.rounds = 1  # ~30 tokens/s: one round
        variant("plain", False)
    for key, r in rows.items():
        base = rows.get("plain" + "_cuda_graphs" * ("_cuda_graphs" in key)
                        + "_triton" * ("_triton" in key) + "_gemv" * ("_gemv" in key))
        if hf_rate:
            r["vs_transformers"] = r["tokens_per_s"] / hf_rate
        if base is not None:
            r["vs_plain"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["lossless"] = r["token_ids"] == base["token_ids"]
        unfused = rows.get(key.replace("_gemv", "")) if "_gemv" in key else None
        if unfused is not None:  # cuBLAS's sums in another order: greedy ties may flip
            r["same_tokens_as_unfused"] = r["token_ids"] == unfused["token_ids"]
    for r in rows.values():
        r.pop("token_ids", None)
    print_json(result, args.json_out, indent=2)


if __name__ == "__main__":
    main()
